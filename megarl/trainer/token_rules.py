"""Batch-level token rules of a policy loss, fitted once over the whole step before the split.

clip_cov and kl_cov select tokens by the batch's covariance of log-prob and advantage
(:mod:`megarl.algo.covariance`): the selection couples every token of the batch, so rank 0,
which holds the whole rollout, fits the rule on every sequence (pruned ones included) and
broadcasts its few numbers; each rank then selects its own sequences' tokens from them
(:meth:`megarl.actor.megatron_actor.MegatronActor._selected_BL`), whatever its share of the
batch and its micro-batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.algo.covariance import CovarianceRule, CovarianceSettings, fit_rule
from megarl.algo.policy_losses import COVARIANCE_LOSSES

if TYPE_CHECKING:
    from megarl.batch import RolloutBatch
    from megarl.config.schema import RunConfig


def covariance_settings(cfg: RunConfig) -> CovarianceSettings:
    a = cfg.actor
    return CovarianceSettings(
        clip_cov_ratio=a.clip_cov_ratio,
        clip_cov_lb=a.clip_cov_lb,
        clip_cov_ub=a.clip_cov_ub,
        kl_cov_ratio=a.kl_cov_ratio,
    )


def rule_seed(cfg: RunConfig, step: int) -> int:
    """clip_cov's random keys differ every step and repeat with ``trainer.seed`` (a resumed run
    draws the same as an uninterrupted one)."""
    return cfg.trainer.seed * 100_003 + step


def fit_covariance_rule(cfg: RunConfig, batch: RolloutBatch, step: int) -> CovarianceRule:
    """Rank 0: the step's rule over every sequence of ``batch``, from the engine's logprobs
    (why those: :mod:`megarl.algo.covariance`)."""
    logps = list(batch.engine_logprobs)
    masks = batch.response_masks
    trained = [
        torch.ones_like(lp, dtype=torch.bool) if masks is None else masks[i] > 0
        for i, lp in enumerate(logps)
    ]
    return fit_rule(
        cfg.actor.policy_loss,
        logps,
        trained,
        batch.advantages.tolist(),
        covariance_settings(cfg),
        rule_seed(cfg, step),
    )


def step_covariance_rule(
    cfg: RunConfig, batch: RolloutBatch | None, step: int
) -> CovarianceRule | None:
    """Collective when the policy loss has a covariance rule: rank 0 fits it over ``batch``
    (the step's whole rollout, with its final advantages), every rank gets it; None (and no
    collective) for every other loss."""
    if cfg.actor.policy_loss not in COVARIANCE_LOSSES:
        return None
    payload: list = [None]
    if dist.get_rank() == 0:
        assert batch is not None  # rank 0 holds the whole rollout
        payload = [fit_covariance_rule(cfg, batch, step)]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]

"""Batch-level token rules of a policy loss, fitted once over the whole step before the split.

Each rule couples every token of the batch, so it is fitted over the whole batch, shipped as a
few numbers, and each rank then selects its own sequences' tokens from them
(:func:`megarl.actor.training_loss.selected_BL`), whatever its share of the
batch and its micro-batches:

* clip_cov and kl_cov select by the batch's covariance of log-prob and advantage
  (:mod:`megarl.algo.covariance`): rank 0, which holds the whole rollout, fits the rule on every
  sequence (pruned ones included) from the engine's logprobs and broadcasts it;
* m2po masks by the second moment of ``log(pi_prox / pi_behav)`` (:mod:`megarl.algo.m2po`):
  the proximal logprobs exist only after the old-logprob pass, on the last pipeline stage of
  each data-parallel rank, for its own sequences, so those ranks gather their tokens' values
  over the data-parallel group and each fits the same cut (the fit sorts, so the order of the
  gathered parts does not matter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.algo import m2po
from megarl.algo.covariance import CovarianceRule, CovarianceSettings, fit_rule
from megarl.algo.policy_losses import COVARIANCE_LOSSES, SECOND_MOMENT_LOSSES
from megarl.batch import response_mask

if TYPE_CHECKING:
    from megarl.batch import RolloutBatch, RolloutShard
    from megarl.config.schema import RunConfig
    from megarl.planner.step_plan import StepPlan
    from megarl.trainer.runtime import Runtime


def step_token_rule(
    rt: Runtime,
    rollout: RolloutBatch | None,
    shard: RolloutShard,
    plan: StepPlan,
    old: Mapping[int, torch.Tensor],
    step: int,
) -> CovarianceRule | m2po.SecondMomentRule | None:
    """The step's token rule of ``actor.policy_loss`` (None for a loss without one); collective
    where the loss has one. ``rollout``: rank 0's whole batch; ``shard``, ``old``: this rank's
    sequences and their recomputed old logprobs."""
    if rt.cfg.actor.policy_loss in COVARIANCE_LOSSES:
        return step_covariance_rule(rt.cfg, rollout, step)
    if rt.cfg.actor.policy_loss in SECOND_MOMENT_LOSSES:
        return step_second_moment_rule(rt, shard, plan, old)
    return None


def step_second_moment_rule(
    rt: Runtime, shard: RolloutShard, plan: StepPlan, old: Mapping[int, torch.Tensor]
) -> m2po.SecondMomentRule | None:
    """m2po's cut over the whole batch (None off the last pipeline stage, which computes no
    loss): every data-parallel rank's squared log weights of its trained tokens with a
    non-zero advantage, gathered over the data-parallel group."""
    if not rt.actor.is_last_stage:
        return None
    from megatron.core import parallel_state as ps

    local = []
    for i in plan.trained_sequences(rt.dp_rank):
        if float(shard.advantages[i]) == 0:
            continue
        if i not in old:
            raise RuntimeError(f"m2po: no recomputed proximal logprobs for sequence {i}")
        engine = shard.engine_logprobs[i]
        mask = response_mask(shard, i)
        trained = torch.ones_like(engine, dtype=torch.bool) if mask is None else mask > 0
        local.append(m2po.squared_log_weight(engine, old[i]).cpu()[trained.cpu()])
    group = ps.get_data_parallel_group()
    parts: list = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(parts, local, group=group)
    squared = [s for part in parts for s in part]
    return m2po.fit_rule(squared, rt.cfg.actor.m2_threshold)


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

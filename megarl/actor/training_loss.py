"""The actor's training loss of one micro-batch: policy loss, KL, entropy and ECHO terms.

What the loss of a micro-batch is, given its per-token logprobs and entropies, lives here apart
from the Megatron actor that runs the forward and the optimizer: it is the part a new loss term
touches, and it reads only the batch and the step's settings (the rollout correction's weights,
the token rule fitted over the whole batch, the gates' old and reference logprobs), never the
model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.algo.covariance import CovarianceRule
from megarl.algo.losses import aggregate, echo_loss, kl_penalty, policy_loss
from megarl.algo.m2po import SecondMomentRule
from megarl.algo.rollout_correction import CorrectionSettings, compute_correction
from megarl.batch import (
    MicroBatchTensors,
    per_token_to_response,
    response_mask,
    response_values_to_BL,
)


@dataclass(frozen=True)
class LossSettings:
    """The ``actor.*`` loss keys a training micro-batch needs (see ``ActorConfig``)."""

    temperature: float
    clip_low: float
    clip_high: float
    agg: str
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    policy_loss: str = "vanilla"
    """A name in :data:`megarl.algo.policy_losses.POLICY_LOSSES`."""
    clip_ratio_c: float = 3.0
    """vanilla's dual-clip bound for negative advantages."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's constant; it is already in the planner's normaliser, so it
    only matters to a loss computed without one."""
    rollout_correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    """``algo.rollout_correction``: IS weights and rejection from old vs engine logprobs."""
    echo_coef: float = 0.0
    """``actor.echo_coef``: ECHO's cross-entropy on observation tokens; 0 = none."""
    loss_keys: Mapping[str, float] = field(default_factory=dict)
    """The loss-specific ``actor.*`` keys (``ActorConfig.loss_keys``: SAPO's temperatures,
    kl_cov's and prime_dppo's coefficients)."""
    token_rule: CovarianceRule | SecondMomentRule | None = None
    """The step's token rule of clip_cov / kl_cov (:mod:`megarl.algo.covariance`) or m2po
    (:mod:`megarl.algo.m2po`), fitted over the whole batch before the split; None for every
    other loss."""


def training_loss(
    logp_BL: torch.Tensor,
    entropy_BL: torch.Tensor,
    mb: MicroBatchTensors,
    *,
    batch,
    old,
    ref,
    loss: LossSettings,
    denom: float,
    capture: bool,
    token_advantages: Mapping[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The micro-batch's loss (to backpropagate), its trained-token count and its statistics
    (sums the step adds up over micro-batches; with ``capture`` the trained sequences' detached
    logprobs). ``token_advantages`` replaces the sequences' advantages per token (on-policy
    distillation)."""
    old_BL = old_logprobs_BL(logp_BL, mb, batch, old)
    # one row per sequence, packed or not (to_rows): what sequence-level losses and
    # seq-mean-token-mean reduce over
    mask_BL = mb.loss_mask_BL
    advantages = mb.advantages_B
    if token_advantages is not None:
        advantages = response_values_to_BL(
            {i: token_advantages[i] for i in mb.seq_indices}, mb, batch
        )
    pg = policy_loss(
        logp_BL,
        old_BL,
        advantages,
        mask_BL,
        loss.clip_low,
        loss.clip_high,
        loss.agg,
        denom=denom,
        loss=loss.policy_loss,
        clip_ratio_c=loss.clip_ratio_c,
        loss_scale_factor=loss.loss_scale_factor,
        token_weights_BT=correction_weights_BL(old_BL, mb, batch, loss),
        loss_keys=loss.loss_keys,
        selected_BT=selected_BL(mb, batch, loss.token_rule, old),
    )
    total = pg.loss
    kl_value = logp_BL.new_zeros(())
    if ref is not None and loss.kl_coef > 0:
        ref_BL = response_values_to_BL(ref, mb, batch)
        kl_value = aggregate(
            kl_penalty(logp_BL, ref_BL, loss.kl_estimator), mask_BL, loss.agg, denom=denom
        )
        total = total + loss.kl_coef * kl_value
    entropy_value = aggregate(entropy_BL, mask_BL, loss.agg, denom=denom)
    if loss.entropy_coef > 0:
        total = total - loss.entropy_coef * entropy_value
    echo_stats = {}
    if loss.echo_coef > 0:
        observation_BL = observation_mask_BL(mb, batch)
        echo_value = echo_loss(logp_BL, observation_BL, loss.agg, denom=denom)
        total = total + loss.echo_coef * echo_value
        echo_stats = {
            "echo_loss": echo_value.detach(),
            "echo_tokens": observation_BL.gt(0).sum(),
        }
    num_tokens = mask_BL.gt(0).sum()
    stats: dict[str, Any] = {
        "pg_loss": pg.loss.detach(),
        "kl_loss": kl_value.detach(),
        "entropy_sum": (entropy_BL.detach() * mb.response_mask_BL).sum(),
        "clipfrac_sum": pg.clipfrac * num_tokens,
        "clipfrac_lower_sum": pg.clipfrac_lower * num_tokens,
        "ppo_kl_sum": pg.ppo_kl * num_tokens,
        "num_tokens": num_tokens.float(),
        "response_tokens": mb.response_mask_BL.sum(),
        **echo_stats,
    }
    if capture:
        trained = [
            i
            for i, w in zip(mb.seq_indices, mb.loss_mask_BL.amax(dim=1).tolist(), strict=True)
            if w > 0
        ]
        captured = per_token_to_response(logp_BL, mb, batch)
        stats["train_logprobs"] = {i: captured[i] for i in trained}
    return total, num_tokens, stats


def observation_mask_BL(mb, batch) -> torch.Tensor:
    """1 on each observation token (a response token of an agent trajectory whose mask is
    0) times its row's loss weight (a filler row's is 0), 0 elsewhere."""
    observations = {}
    for i in mb.seq_indices:
        mask = response_mask(batch, i)
        length = len(batch.tokens[i]) - batch.prompt_lens[i]
        observations[i] = torch.zeros(length) if mask is None else 1.0 - mask.float()
    row_weight_B1 = mb.loss_mask_BL.amax(dim=1, keepdim=True)
    return response_values_to_BL(observations, mb, batch) * row_weight_B1


def correction_weights_BL(old_BL, mb, batch, loss: LossSettings) -> torch.Tensor | None:
    """The rollout correction's per-token factor (IS weight x rejection mask) from the old
    logprobs, which are the trainer's own (the gates never let the engine's stand in while
    it is on), against the engine's; None while it is off."""
    if not loss.rollout_correction.enabled:
        return None
    engine = {i: batch.engine_logprobs[i] for i in mb.seq_indices}
    rollout_BL = response_values_to_BL(engine, mb, batch)
    correction = compute_correction(old_BL, rollout_BL, mb.loss_mask_BL, loss.rollout_correction)
    return correction.token_weights_BT


def selected_BL(
    mb, batch, rule: CovarianceRule | SecondMomentRule | None, old
) -> torch.Tensor | None:
    """The tokens the step's token rule selects in this micro-batch's sequences, each from
    its own engine logprobs (and, for m2po, its recomputed proximal ones), trained tokens
    and advantage, so any split agrees with the whole batch; None without a rule."""
    if rule is None:
        return None
    picked = {}
    for i in mb.seq_indices:
        engine = batch.engine_logprobs[i]
        mask = response_mask(batch, i)
        trained = torch.ones_like(engine, dtype=torch.bool) if mask is None else mask > 0
        adv = float(batch.advantages[i])
        if isinstance(rule, SecondMomentRule):  # the gates recomputed every sequence
            chosen = rule.select(engine, old.get(i, engine), trained, adv)
        else:
            chosen = rule.select(i, engine, trained, adv)
        picked[i] = chosen.to(engine.dtype)
    return response_values_to_BL(picked, mb, batch) > 0


def old_logprobs_BL(logp_BL, mb, batch, old) -> torch.Tensor:
    """Provided old logprobs where the gates recomputed them, else the detached forward's."""
    has_old_B = torch.tensor([i in old for i in mb.seq_indices], device=logp_BL.device)
    if not has_old_B.any():
        return logp_BL.detach()
    provided = response_values_to_BL({i: old[i] for i in mb.seq_indices if i in old}, mb, batch)
    return torch.where(has_old_B.unsqueeze(1), provided, logp_BL.detach())

"""Statistics of the actor update: per optimizer step, then the step's ``actor/*`` metrics.

Pure Python (no torch code, no distributed), so the reduction rule is unit-tested on plain
numbers. The Megatron rank runs :class:`OptimizerStepStats` per optimizer step, sums them over
the world (one all-reduce of their :meth:`~megarl.algo.summable.SummableStats.to_row` rows), and
:func:`summarise_update` turns the global rows into the metrics the step reports.

Every ``actor/*`` metric is the **mean over optimizer steps** of that step's value, as verl
reports it: with ``actor.ppo_mini_batches=2, actor.ppo_epochs=2`` the four optimizer steps each
contribute a quarter. (Summing the losses over steps would grow them with the number of
mini-batches and epochs, while the gradient norm was averaged: the two disagreed.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from megarl.algo.summable import SummableStats


@dataclass(frozen=True)
class OptimizerStepStats(SummableStats):
    """One optimizer step on one rank: sums over its micro-batches.

    The losses are already divided by the step's global normaliser, so their sum over the
    world's ranks is the step's loss; the ``*_sum`` fields are per-token sums, divided by the
    step's global token count only after the reduction.
    """

    pg_loss: float = 0.0
    kl_loss: float = 0.0
    entropy_sum: float = 0.0
    """Entropy summed over response tokens (unweighted: fillers' tokens carry weight 0)."""
    response_tokens: float = 0.0
    clipfrac_sum: float = 0.0
    ppo_kl_sum: float = 0.0
    num_tokens: float = 0.0
    """Tokens with a non-zero loss weight (what clip fraction and PPO-KL are averaged over)."""
    clipfrac_lower_sum: float = 0.0
    """Tokens on which vanilla's dual clip (negative advantages) is active."""


Stats = TypeVar("Stats", bound=SummableStats)


def sum_micro_batches(stats: type[Stats], per_micro_batch: Iterable[Mapping[str, Any]]) -> Stats:
    """One rank's statistics of an optimizer step (the actor's, the critic's): the sum of its
    micro-batches' entries (numbers or 0-d tensors, by field name), zero when it ran none."""
    total = stats()
    for entry in per_micro_batch:
        total = total + stats(**{k: float(v) for k, v in entry.items()})
    return total


@dataclass(frozen=True)
class UpdateStats:
    """The actor update of one training step, as reported (``actor/*`` and the lp check)."""

    pg_loss: float
    kl_loss: float
    entropy: float
    pg_clipfrac: float
    ppo_kl: float
    grad_norm: float
    num_optimizer_steps: int
    logprob_abs_diff: float
    """Mean |engine - trainer| logprob over the tokens compared (0.0 when none were)."""
    pg_clipfrac_lower: float = 0.0
    """Fraction of trained tokens on which the dual clip for negative advantages is active."""
    rollout_corr: Mapping[str, float] = field(default_factory=dict)
    """The ``rollout_corr/*`` engine-vs-trainer mismatch metrics of the same tokens."""
    routing_mismatch: Mapping[str, float] = field(default_factory=dict)
    """Mixture-of-experts models: ``rollout/moe_routing_mismatch*``, the engine's and the
    trainer's experts for the same tokens (empty when nothing was compared)."""
    skipped_nonfinite_updates: int = 0
    """Optimizer steps whose gradient norm was not finite, skipped
    (``trainer.skip_nonfinite_updates``); the statistics above are of the applied ones."""

    def metrics(self) -> dict[str, float]:
        """verl's metric names."""
        return {
            "actor/pg_loss": self.pg_loss,
            "actor/kl_loss": self.kl_loss,
            "actor/entropy": self.entropy,
            "actor/pg_clipfrac": self.pg_clipfrac,
            "actor/pg_clipfrac_lower": self.pg_clipfrac_lower,
            "actor/ppo_kl": self.ppo_kl,
            "actor/grad_norm": self.grad_norm,
            "actor/num_optimizer_steps": self.num_optimizer_steps,
            "rollout/logprob_abs_diff": self.logprob_abs_diff,
            "actor/skipped_nonfinite_updates": float(self.skipped_nonfinite_updates),
            **self.rollout_corr,
            **self.routing_mismatch,
        }


def summarise_update(
    global_steps: Sequence[OptimizerStepStats],
    grad_norms: Sequence[float],
    lp_diff_sum: float = 0.0,
    lp_diff_count: float = 0.0,
    rollout_corr: Mapping[str, float] | None = None,
    routing_mismatch: Mapping[str, float] | None = None,
) -> UpdateStats:
    """Mean over optimizer steps of each step's value.

    ``global_steps`` are already summed over the world. Per-token ratios (entropy, clip
    fraction, PPO-KL) are formed within each step; a step with no trained tokens (a ghost
    step, kept only so the optimizer's state advances as in the unpruned run) has no such ratio
    and is left out of their mean, while the losses and gradient norm count every step.
    """
    if len(global_steps) != len(grad_norms):
        raise ValueError(f"{len(global_steps)} optimizer steps but {len(grad_norms)} grad norms")
    n = len(global_steps)
    applied = [i for i, norm in enumerate(grad_norms) if math.isfinite(norm)]
    global_steps = [global_steps[i] for i in applied]  # a skipped update reports nothing
    grad_norms = [grad_norms[i] for i in applied]
    with_tokens = [s for s in global_steps if s.num_tokens > 0]
    return UpdateStats(
        pg_loss=mean_over_steps([s.pg_loss for s in global_steps]),
        kl_loss=mean_over_steps([s.kl_loss for s in global_steps]),
        entropy=mean_over_steps(
            [s.entropy_sum / s.response_tokens for s in global_steps if s.response_tokens > 0]
        ),
        pg_clipfrac=mean_over_steps([s.clipfrac_sum / s.num_tokens for s in with_tokens]),
        ppo_kl=mean_over_steps([s.ppo_kl_sum / s.num_tokens for s in with_tokens]),
        grad_norm=mean_over_steps(list(grad_norms)),
        num_optimizer_steps=n,
        logprob_abs_diff=lp_diff_sum / lp_diff_count if lp_diff_count > 0 else 0.0,
        pg_clipfrac_lower=mean_over_steps(
            [s.clipfrac_lower_sum / s.num_tokens for s in with_tokens]
        ),
        rollout_corr=dict(rollout_corr or {}),
        routing_mismatch=dict(routing_mismatch or {}),
        skipped_nonfinite_updates=n - len(applied),
    )


def mean_over_steps(values: Sequence[float]) -> float:
    """The mean of per-optimizer-step values (0.0 for none): how every step metric reports."""
    return sum(values) / len(values) if values else 0.0

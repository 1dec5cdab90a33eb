"""Statistics of the critic update: per optimizer step, then the step's ``critic/*`` metrics.

The critic's counterpart of :mod:`megarl.actor.train_stats`, under the same rule: each rank sums
its micro-batches into a :class:`CriticStepStats` per optimizer step, the rows are summed over
the world in one all-reduce, and every metric is the mean over optimizer steps of that step's
global value (verl's convention). Pure Python, unit-tested on plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megarl.actor.train_stats import mean_over_steps
from megarl.algo.summable import SummableStats


@dataclass(frozen=True)
class CriticStepStats(SummableStats):
    """Sums over one optimizer step's micro-batches on this rank (0 off the last stage); one
    :meth:`~megarl.algo.summable.SummableStats.to_row` per step is summed over the ranks."""

    vf_loss: float = 0.0
    """The step's loss; its micro-batches share the step's normaliser, so they add up."""
    vf_clipfrac_sum: float = 0.0
    vpred_sum: float = 0.0
    num_tokens: float = 0.0


def summarise_critic_update(
    global_steps: Sequence[CriticStepStats], grad_norms: Sequence[float]
) -> dict[str, float]:
    """verl's ``critic/*`` update metrics from steps already summed over the world: per-token
    ratios are formed within each step, and a step with no trained tokens (a ghost step) is
    left out of their mean, while the loss and gradient norm count every step."""
    with_tokens = [s for s in global_steps if s.num_tokens > 0]
    return {
        "critic/vf_loss": mean_over_steps([s.vf_loss for s in global_steps]),
        "critic/vf_clipfrac": mean_over_steps(
            [s.vf_clipfrac_sum / s.num_tokens for s in with_tokens]
        ),
        "critic/vpred_mean": mean_over_steps([s.vpred_sum / s.num_tokens for s in with_tokens]),
        "critic/grad_norm": mean_over_steps(list(grad_norms)),
    }

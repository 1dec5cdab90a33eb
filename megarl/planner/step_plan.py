"""The plan types: what every DP rank runs in one training step, as frozen values.

:func:`~megarl.planner.batch_planner.plan_step` returns a :class:`StepPlan`; the actor, the
critic and the scatter of the rollout batch only read it. Nesting follows execution: a
:class:`StepPlan` is a sequence of :class:`OptimizerStepPlan` (one ``optimizer.step()`` each),
each holds one :class:`RankPlan` per DP rank, each a sequence of :class:`MicroBatch` (one
forward+backward). Every type checks its own shape in ``__post_init__`` (equal micro-batch
counts across ranks, a ghost step iff no micro-batch, loss weights 0 or 1), so a plan that
breaks the invariants of :mod:`megarl.planner.batch_planner` cannot be built. Summaries and
``planner/*`` metrics are computed here, from the plan alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MicroBatch:
    """One forward+backward pass on one rank."""

    seq_indices: tuple[int, ...]
    """Indices into the rollout batch (trained ones ascending, or a single filler)."""
    loss_weights: tuple[float, ...]
    """Per sequence: 1.0 = trained, 0.0 = filler (computed, contributes no gradient)."""
    num_tokens: int
    """Sum of ``seq_tokens`` over ``seq_indices``."""

    def __post_init__(self) -> None:
        if not self.seq_indices:
            raise ValueError("seq_indices is empty: a micro-batch holds at least one sequence")
        if len(self.loss_weights) != len(self.seq_indices):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} entries but seq_indices has "
                f"{len(self.seq_indices)}"
            )
        if not set(self.loss_weights) <= {0.0, 1.0}:
            raise ValueError(f"loss_weights must be 0.0 or 1.0, got {set(self.loss_weights)}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")

    @property
    def num_trained(self) -> int:
        """Sequences at loss weight 1."""
        return sum(1 for weight in self.loss_weights if weight == 1.0)

    @property
    def num_fillers(self) -> int:
        """Sequences at loss weight 0."""
        return len(self.loss_weights) - self.num_trained


@dataclass(frozen=True)
class RankPlan:
    """The micro-batches one DP rank runs, in order, within one optimizer step."""

    micro_batches: tuple[MicroBatch, ...]
    """Empty only in a ghost step."""

    @property
    def num_micro_batches(self) -> int:
        """How many forward+backward passes this rank runs."""
        return len(self.micro_batches)

    @property
    def num_fillers(self) -> int:
        """Filler sequences (loss weight 0) on this rank."""
        return sum(micro_batch.num_fillers for micro_batch in self.micro_batches)


@dataclass(frozen=True)
class OptimizerStepPlan:
    """One ``optimizer.step()``: the micro-batches of every rank and their shared normaliser."""

    epoch: int
    """PPO epoch, 0-based."""
    mini_batch: int
    """Baseline mini-batch index (``off``/``match_loss_curve``) or merged run index (``fast``)."""
    source_mini_batches: tuple[int, ...]
    """The baseline mini-batches this step covers: ``(mini_batch,)`` unless ``fast`` merged."""
    ranks: tuple[RankPlan, ...]
    """One plan per DP rank (``len == dp_size``), all with the same micro-batch count."""
    normaliser: float
    """Every micro-batch divides its loss sum by this:
    :func:`~megarl.planner.optimizer_steps.normaliser_of` the unpruned covered mini-batches
    (response tokens, sequences, or sequences x loss_scale_factor)."""
    is_ghost: bool
    """No micro-batch anywhere; the trainer still steps the optimizer on zero gradients."""
    rank_costs: tuple[float, ...] = field(default=())
    """Estimated cost per rank (fillers included); empty for a ghost step."""
    trained_cost: float = 0.0
    """Estimated cost of the trained sequences summed over ranks (fillers excluded)."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("ranks is empty: a step needs at least one DP rank")
        counts = {rank.num_micro_batches for rank in self.ranks}
        if len(counts) != 1:
            raise ValueError(f"ranks have unequal micro-batch counts {sorted(counts)}")
        if self.is_ghost != (counts == {0}):
            raise ValueError(
                f"is_ghost={self.is_ghost} but ranks have {counts.pop()} micro-batches each"
            )
        if not (math.isfinite(self.normaliser) and self.normaliser >= 0):
            raise ValueError(f"normaliser must be finite and >= 0, got {self.normaliser!r}")
        if self.rank_costs and len(self.rank_costs) != len(self.ranks):
            raise ValueError(
                f"rank_costs has {len(self.rank_costs)} entries for {len(self.ranks)} ranks"
            )

    @classmethod
    def by_hand(
        cls, groups: Sequence[Sequence[int]], seq_tokens: Sequence[int], normaliser: float
    ) -> OptimizerStepPlan:
        """One rank training every sequence of ``groups`` (one micro-batch each): for tests and
        benchmarks that drive the actor without the planner."""
        micro_batches = tuple(
            MicroBatch(tuple(g), (1.0,) * len(g), sum(seq_tokens[i] for i in g)) for g in groups
        )
        return cls(0, 0, (0,), (RankPlan(micro_batches),), float(normaliser), is_ghost=False)

    @property
    def num_micro_batches_per_rank(self) -> int:
        """Micro-batches each rank runs in this step (0 for a ghost step)."""
        return self.ranks[0].num_micro_batches


@dataclass(frozen=True)
class StepPlan:
    """The whole training step for one rollout batch: every optimizer step, in order."""

    optimizer_steps: tuple[OptimizerStepPlan, ...]
    """In execution order: epoch-major, then mini-batch (or merged run)."""
    approximate: bool
    """True when zero-advantage sequences were pruned although a KL/entropy term was active."""
    reasons: tuple[str, ...]
    """Short human-readable notes on what was pruned, merged, ghosted or padded."""
    num_sequences: int
    """N, sequences in the rollout batch."""
    num_kept_sequences: int
    """Sequences trained each epoch (all of them in ``off``)."""
    num_tokens: int
    """Sum of ``seq_tokens`` over the batch."""
    num_kept_tokens: int
    """Sum of ``seq_tokens`` over the kept sequences."""
    pruning_refused: str | None = None
    """Why this plan could not prune at all
    (:func:`~megarl.planner.pruning.pruning_refusal`); shown in the summary."""

    def __post_init__(self) -> None:
        if not self.optimizer_steps:
            raise ValueError("optimizer_steps is empty: a plan has at least one step")
        if not 0 <= self.num_kept_sequences <= self.num_sequences:
            raise ValueError(
                f"num_kept_sequences={self.num_kept_sequences} outside [0, {self.num_sequences}]"
            )
        if not 0 <= self.num_kept_tokens <= self.num_tokens:
            raise ValueError(f"num_kept_tokens={self.num_kept_tokens} outside [0, num_tokens]")

    @property
    def num_ghost_steps(self) -> int:
        """Optimizer steps with no micro-batch (over all epochs)."""
        return sum(step.is_ghost for step in self.optimizer_steps)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches over all ranks and steps."""
        return sum(
            step.num_micro_batches_per_rank * len(step.ranks) for step in self.optimizer_steps
        )

    @property
    def num_filler_seqs(self) -> int:
        """Filler sequences over all ranks and steps."""
        return sum(rank.num_fillers for step in self.optimizer_steps for rank in step.ranks)

    @property
    def dp_imbalance(self) -> float:
        """Estimated wall time over ideal time across DP ranks, >= 1.0.

        Sum over non-ghost steps of the slowest rank's cost (fillers included -- they are real
        work) divided by the sum over those steps of the mean *trained* cost per rank. For one
        step this is ``max / mean``; over several it weighs each step by its cost, which is how
        the steps add up in wall time. 1.0 when there is no non-ghost step.
        """
        slowest = ideal = 0.0
        for step in self.optimizer_steps:
            if not step.is_ghost:
                slowest += max(step.rank_costs, default=0.0)
                ideal += step.trained_cost / len(step.ranks)
        return slowest / ideal if ideal > 0 else 1.0

    @property
    def metrics(self) -> dict[str, float]:
        """Scalars for the experiment logger (token fractions count prompt + response tokens)."""
        return {
            "planner/kept_seq_frac": self.num_kept_sequences / self.num_sequences,
            "planner/kept_token_frac": self.num_kept_tokens / self.num_tokens,
            "planner/dp_imbalance": self.dp_imbalance,
            "planner/num_micro_batches": float(self.num_micro_batches),
            "planner/ghost_steps": float(self.num_ghost_steps),
            "planner/filler_seqs": float(self.num_filler_seqs),
            "planner/optimizer_steps": float(len(self.optimizer_steps)),
        }

    def trained_sequences(self, dp_rank: int) -> tuple[int, ...]:
        """Sequences ``dp_rank`` trains (loss weight 1) anywhere in the plan, in first-use order.

        These are the sequences whose old/reference logprobs that rank needs.
        """
        seen: dict[int, None] = {}
        for step in self.optimizer_steps:
            for mb in step.ranks[dp_rank].micro_batches:
                for index, weight in zip(mb.seq_indices, mb.loss_weights, strict=True):
                    if weight > 0:
                        seen.setdefault(index, None)
        return tuple(seen)

    def sequences_on_rank(self, dp_rank: int) -> tuple[int, ...]:
        """Every sequence ``dp_rank`` runs anywhere in the plan, fillers included, ascending:
        the part of the rollout batch that rank must receive."""
        return tuple(
            sorted(
                {
                    index
                    for step in self.optimizer_steps
                    for mb in step.ranks[dp_rank].micro_batches
                    for index in mb.seq_indices
                }
            )
        )

    def summary(self) -> str:
        """One line, e.g. ``keep 4/16 seq (27% tok) | 2 steps (1 ghost) | 1 mb/rank | imb 1.01``."""
        per_rank = _span(
            {step.num_micro_batches_per_rank for step in self.optimizer_steps if not step.is_ghost}
        )
        approx = " | APPROX" if self.approximate else ""
        refused = f" | no pruning: {self.pruning_refused}" if self.pruning_refused else ""
        return (
            f"keep {self.num_kept_sequences}/{self.num_sequences} seq "
            f"({self.num_kept_tokens / self.num_tokens:.0%} tok) | "
            f"{len(self.optimizer_steps)} steps ({self.num_ghost_steps} ghost) | "
            f"{per_rank} mb/rank | imb {self.dp_imbalance:.2f}{approx}{refused}"
        )


def _span(values: set[int]) -> str:
    """``"2"`` or ``"2-3"`` for the smallest to largest value; ``"0"`` when empty."""
    if not values:
        return "0"
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"

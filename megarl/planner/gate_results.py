"""What the pass gates decide, as values: one :class:`PassGate` per pass and step, collected in
:class:`StepGates`, and the run's :class:`ReferencePlan`.

:mod:`megarl.planner.gates` decides them; the trainer's logprob passes and weight sync read
them and nothing else. Every gate carries its reason, and :meth:`StepGates.metrics` and
:meth:`StepGates.summary` turn a step's gates into the ``gates/*`` metrics and the console line,
so what a step skipped and why is always logged beside the step. The types check their own
shape (a gate that does not run names no sequence; sequences sorted and unique).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class OldLogProbSource(str, Enum):
    """Where a sequence's old logprobs come from."""

    RECOMPUTE = "recompute"
    TRAIN_FORWARD = "train_forward"
    ROLLOUT = "rollout"


class ReferenceSource(str, Enum):
    """Where the reference logprobs of a run come from (decided once, at start-up)."""

    NONE = "none"
    """No step needs them: no reference model is built or kept in memory."""
    MODEL = "model"
    """A frozen copy of the initial weights, built beside the actor."""
    ACTOR_WITHOUT_ADAPTERS = "actor_without_adapters"
    """LoRA: the actor's frozen base *is* the initial model; its forward with the adapters
    disabled gives the reference logprobs, and no second model is built."""


@dataclass(frozen=True)
class PassGate:
    """Whether one expensive pass runs, on which sequences, and why."""

    run: bool
    reason: str
    """Short human-readable cause of the decision (logged and shown in the console)."""
    seq_indices: tuple[int, ...] = ()
    """Sorted sequences the pass runs on (empty when it does not run or has no per-sequence
    scope, like a weight sync)."""
    source: OldLogProbSource | None = None
    """Old-logprob gate only: RECOMPUTE when it runs (``seq_indices`` are recomputed; every
    other sequence uses TRAIN_FORWARD), TRAIN_FORWARD when nothing is recomputed, ROLLOUT when
    the engine's sampled logprobs stand in for all sequences. None for the other passes."""

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("a gate needs a reason")
        if not self.run and self.seq_indices:
            raise ValueError("a gate that does not run cannot name sequences")
        if list(self.seq_indices) != sorted(set(self.seq_indices)):
            raise ValueError(f"seq_indices must be sorted and unique, got {self.seq_indices}")

    @classmethod
    def recompute(cls, seq_indices: tuple[int, ...], reason: str) -> PassGate:
        """Old-logprob gate: recompute ``seq_indices``; the rest take the train forward's."""
        return cls(
            run=True, seq_indices=seq_indices, source=OldLogProbSource.RECOMPUTE, reason=reason
        )

    @classmethod
    def train_forward(cls, reason: str) -> PassGate:
        """Old-logprob gate: no recompute, the training forward's logprobs are the old ones."""
        return cls(run=False, source=OldLogProbSource.TRAIN_FORWARD, reason=reason)

    @classmethod
    def rollout(cls, reason: str) -> PassGate:
        """Old-logprob gate: no recompute, the engine's sampled logprobs stand in for all."""
        return cls(run=False, source=OldLogProbSource.ROLLOUT, reason=reason)


@dataclass(frozen=True)
class StepGates:
    """The decisions for one RL step; workers execute these and nothing else."""

    step: int
    num_sequences: int
    """Sequences in the rollout, the denominator of ``gates/old_log_prob_frac``."""
    old_log_prob: PassGate
    """Old-logprob forward; must run before the rollout's first optimizer step."""
    ref_log_prob: PassGate
    base_weight_sync: PassGate
    """Sync of base (or, without LoRA, full) weights to the rollout engine."""
    adapter_sync: PassGate
    teacher_log_prob: PassGate = PassGate(run=False, reason="no algo.distill.teacher_path")
    """The distillation teacher's forward (it runs before the plan, where the advantages are
    made); shown in the reasons and the summary only when it runs."""

    def metrics(self) -> dict[str, float | str]:
        """Per-step metrics, exactly the four ``gates/*`` keys."""
        reasons = [f"{label}: {gate.reason}" for label, _, gate in self._shown()]
        return {
            "gates/old_log_prob_frac": len(self.old_log_prob.seq_indices) / self.num_sequences,
            "gates/ref_log_prob": float(self.ref_log_prob.run),
            "gates/base_weight_sync": float(self.base_weight_sync.run),
            "gates/reasons": "; ".join(reasons),
        }

    def _shown(self) -> list[tuple[str, str, PassGate]]:
        """The gates the reasons and the summary show, in their order, as ``(label, action,
        gate)``; the teacher's only when it runs."""
        shown = [
            ("old_lp", self._old_action(), self.old_log_prob),
            ("ref", "run" if self.ref_log_prob.run else "skip", self.ref_log_prob),
            ("sync", self._sync_action(), self.base_weight_sync),
        ]
        if self.teacher_log_prob.run:
            shown.insert(2, ("teacher", "run", self.teacher_log_prob))
        return shown

    def _old_action(self) -> str:
        """Which logprobs are "old": the engine's, or the trainer's (recomputed, and the
        training forward's for the rest)."""
        if self.old_log_prob.source is OldLogProbSource.ROLLOUT:
            return "rollout logprobs"
        recomputed = len(self.old_log_prob.seq_indices)
        if recomputed == 0:
            return "train forward"
        action = f"{recomputed}/{self.num_sequences} recompute"
        return action if recomputed == self.num_sequences else f"{action}, rest train forward"

    def _sync_action(self) -> str:
        """What the weight sync sends: the full weights, the base and/or the adapter, or nothing."""
        if not self.adapter_sync.run:
            return "full weights" if self.base_weight_sync.run else "skip"
        return "base + adapter" if self.base_weight_sync.run else "adapter only"

    def summary(self) -> str:
        """One console line, e.g. ``old_lp: 8/16 recompute, rest train forward (mb1 after
        step) | ref: skip (actor.kl_coef=0) | sync: adapter only (engine kept base)``."""
        return " | ".join(
            f"{label}: {action} ({gate.reason})" for label, action, gate in self._shown()
        )


@dataclass(frozen=True)
class ReferencePlan:
    """Where the run's reference logprobs come from, and why."""

    source: ReferenceSource
    reason: str

"""Per-step gates: which expensive passes run this RL step, for which sequences, and why.

One pure function, :func:`decide_gates`, takes the facts of a step (:class:`StepFacts`) and
returns :class:`StepGates`, one :class:`PassGate` per expensive pass, each with a reason. Workers
only execute the gates; no skip decision lives inline in GPU code. Start-up checks for unsafe
forced choices live in :func:`validate_gate_config`; :func:`decide_reference` decides at start-up
where reference logprobs come from: nowhere (no model built), a frozen model copy, or -- with
LoRA, whose base weights never change -- the actor itself with its adapters disabled.

The passes and their rules:

* **Old-logprob forward** (behaviour-policy logprobs for the PPO ratio). If the weights that
  generated a rollout are still the weights when one of its slices is consumed, the training
  forward's own detached logprobs *are* the old logprobs and a separate forward is wasted.
  Under ``planner.old_log_prob="auto"`` the gate recomputes, per slice, only the slices some
  use of which comes after an optimizer step that followed the rollout's generation. The
  recomputation must see the generating weights, so the trainer runs it up front, before the
  first optimizer step after generation, for exactly the flagged sequences.
* **Reference-logprob forward**: only while a KL term is non-zero at this step
  (``actor.kl_coef`` for the KL loss, ``algo.kl_reward_coef`` for the reward penalty).
* **Weight sync to the rollout engine**: without LoRA the full weights; with LoRA the adapter,
  plus the base weights only when the engine *reports* it freed them (never inferred from
  config: a sleep level that keeps weights is the engine's business, not ours).

Schedule conventions (:class:`Schedule`; ``S = steps_per_generation``,
``I = num_iterations``, ``G = grad_accum``, ``K = S // I`` slices per rollout):

1. Micro-steps ``t = 0, 1, 2, ...`` each consume exactly one slice (forward + backward).
2. Rollout ``r`` is generated at the *start* of micro-step ``r * S``, before that micro-step
   runs, with the weights current at that moment (i.e. after any optimizer step that followed
   micro-step ``r * S - 1``). ``S`` is the rollout period in micro-steps, all epochs included.
3. A rollout is consumed epoch-major: micro-step ``t`` reads slice ``(t % S) % K`` in epoch
   ``(t % S) // K`` of rollout ``t // S``. Every slice is used once per epoch, ``I`` epochs.
4. An optimizer step follows micro-step ``t`` iff ``(t + 1) % G == 0``. The accumulation
   counter runs across rollout boundaries (a new rollout does not reset it).

Hence the weight version seen by micro-step ``t`` is ``t // G`` (optimizer steps completed
before it), and the closed-form rule is O(1) per slice use::

    stale(t)  <=>  t // G  >  (r * S) // G,   r = t // S

Staleness is monotone inside a rollout, so slice ``k`` of rollout ``r`` needs recomputation
iff its *last* use (epoch ``I - 1``) is stale. A schedule is fully on-policy iff ``G % S == 0``
(every optimizer step falls on a rollout boundary), the same condition as TRL's static rule
``gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0``.

Worked example, ``S=2, I=1, G=3`` over micro-steps 0..11: rollouts are generated at 0, 2, 4,
6, 8, 10; optimizer steps follow micro-steps 2, 5, 8, 11. Rollout 1 (generated at 2) is read at
2 and 3 with a step after 2, so micro-step 3 is stale; likewise micro-step 9 (rollout 4). Only
2 of every 6 rollouts need any recomputation, and only their second slice; the static rule
recomputes all 6. ``tests/unit/test_gates.py`` checks the rule against a brute-force event
simulation of the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

Coef = float | Callable[[int], float]
"""A KL coefficient: a constant, or a schedule ``step -> value`` (evaluated per step)."""


class GateConfigError(ValueError):
    """An unsafe forced gate choice, reported at start-up with the settings that conflict."""


class OldLogProbMode(str, Enum):
    """``planner.old_log_prob``: where the PPO ratio's old (behaviour) logprobs come from."""

    AUTO = "auto"
    ALWAYS = "always"
    ROLLOUT = "rollout"
    NEVER = "never"


class RefLogProbMode(str, Enum):
    """``planner.ref_log_prob``: whether the reference-model forward runs."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class OldLogProbSource(str, Enum):
    """Where a sequence's old logprobs come from."""

    RECOMPUTE = "recompute"
    TRAIN_FORWARD = "train_forward"
    ROLLOUT = "rollout"


class ScheduleOrigin(Enum):
    """Which config a :class:`Schedule` came from; used only to name settings in errors."""

    GENERIC = "generic"
    PPO = "ppo"
    TRL = "trl"


# --------------------------------------------------------------------------------------------
# Schedule and the closed-form staleness rule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """How micro-steps, rollouts and optimizer steps interleave (see the module docstring)."""

    steps_per_generation: int
    """Rollout period in micro-steps, all epochs included: a rollout is generated every this
    many micro-steps. Must be a multiple of ``num_iterations``. (TRL's ``steps_per_generation``
    counts slices instead; use :meth:`from_trl`.)"""

    num_iterations: int = 1
    """Epochs over each rollout: every slice is consumed this many times."""

    grad_accum: int = 1
    """Micro-steps per optimizer step; the counter runs across rollout boundaries."""

    origin: ScheduleOrigin = field(default=ScheduleOrigin.GENERIC, compare=False)
    """Config the schedule came from, so errors name the user's own settings."""

    def __post_init__(self) -> None:
        _require_positive_int("schedule.steps_per_generation", self.steps_per_generation)
        _require_positive_int("schedule.num_iterations", self.num_iterations)
        _require_positive_int("schedule.grad_accum", self.grad_accum)
        if self.steps_per_generation % self.num_iterations:
            raise ValueError(
                f"schedule.steps_per_generation={self.steps_per_generation} must be a multiple "
                f"of schedule.num_iterations={self.num_iterations} (it counts all epochs)"
            )

    @classmethod
    def from_ppo(cls, ppo_mini_batches: int, ppo_epochs: int) -> Schedule:
        """megarl's loop: one rollout per step, split into ``ppo_mini_batches`` slices, each
        mini-batch ending in an optimizer step, the whole repeated ``ppo_epochs`` times."""
        _require_positive_int("actor.ppo_mini_batches", ppo_mini_batches)
        _require_positive_int("actor.ppo_epochs", ppo_epochs)
        return cls(
            steps_per_generation=ppo_mini_batches * ppo_epochs,
            num_iterations=ppo_epochs,
            grad_accum=1,
            origin=ScheduleOrigin.PPO,
        )

    @classmethod
    def from_trl(
        cls, steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int
    ) -> Schedule:
        """TRL's GRPO loop, whose ``steps_per_generation`` counts slices per rollout; it
        regenerates every ``steps_per_generation * num_iterations`` micro-steps."""
        _require_positive_int("steps_per_generation", steps_per_generation)
        _require_positive_int("num_iterations", num_iterations)
        _require_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
        return cls(
            steps_per_generation=steps_per_generation * num_iterations,
            num_iterations=num_iterations,
            grad_accum=gradient_accumulation_steps,
            origin=ScheduleOrigin.TRL,
        )

    @property
    def slices_per_rollout(self) -> int:
        """Distinct slices a rollout is split into (mini-batches in megarl's loop)."""
        return self.steps_per_generation // self.num_iterations

    @property
    def is_on_policy(self) -> bool:
        """True iff no slice is ever consumed after an optimizer step that followed its
        rollout's generation, i.e. every optimizer step falls on a rollout boundary."""
        return self.grad_accum % self.steps_per_generation == 0

    def off_policy_settings(self) -> str:
        """Name the user's settings that make this schedule off-policy ("" if on-policy)."""
        if self.is_on_policy:
            return ""
        if self.origin is ScheduleOrigin.PPO:
            return _ppo_off_policy_settings(self.slices_per_rollout, self.num_iterations)
        if self.origin is ScheduleOrigin.TRL:
            return (
                f"steps_per_generation={self.slices_per_rollout}, "
                f"num_iterations={self.num_iterations}, "
                f"gradient_accumulation_steps={self.grad_accum} (not a multiple of "
                f"steps_per_generation * num_iterations)"
            )
        return (
            f"schedule.steps_per_generation={self.steps_per_generation}, "
            f"schedule.grad_accum={self.grad_accum} (not a multiple of steps_per_generation)"
        )


def _ppo_off_policy_settings(ppo_mini_batches: int, ppo_epochs: int) -> str:
    """The PPO settings (> 1) that put optimizer steps inside a rollout's use."""
    settings = []
    if ppo_mini_batches > 1:
        settings.append(f"actor.ppo_mini_batches={ppo_mini_batches}")
    if ppo_epochs > 1:
        settings.append(f"actor.ppo_epochs={ppo_epochs}")
    return ", ".join(settings)


@dataclass(frozen=True)
class SliceUse:
    """One micro-step's consumption of one slice."""

    micro_step: int
    """Index of the micro-step (0-based, global)."""

    rollout: int
    """Index of the rollout the micro-step reads."""

    slice_index: int
    """Which slice of that rollout, ``0 .. slices_per_rollout - 1``."""

    epoch: int
    """Which pass over the rollout, ``0 .. num_iterations - 1``."""

    version_at_generation: int
    """Optimizer steps completed when the rollout was generated."""

    version_at_use: int
    """Optimizer steps completed when this micro-step runs."""

    @property
    def stale(self) -> bool:
        """True iff the weights changed between generation and this use."""
        return self.version_at_use > self.version_at_generation


def rollout_of(schedule: Schedule, micro_step: int) -> int:
    """The rollout micro-step ``micro_step`` reads."""
    return micro_step // schedule.steps_per_generation


def generation_micro_step(schedule: Schedule, rollout: int) -> int:
    """The micro-step at whose start rollout ``rollout`` is generated."""
    return rollout * schedule.steps_per_generation


def weights_version_before(schedule: Schedule, micro_step: int) -> int:
    """Optimizer steps completed before ``micro_step`` starts (one after every G-th)."""
    return micro_step // schedule.grad_accum


def slice_use(schedule: Schedule, micro_step: int) -> SliceUse:
    """The closed-form rule for one micro-step: O(1) arithmetic on indices."""
    rollout = rollout_of(schedule, micro_step)
    offset = micro_step - generation_micro_step(schedule, rollout)
    return SliceUse(
        micro_step=micro_step,
        rollout=rollout,
        slice_index=offset % schedule.slices_per_rollout,
        epoch=offset // schedule.slices_per_rollout,
        version_at_generation=weights_version_before(
            schedule, generation_micro_step(schedule, rollout)
        ),
        version_at_use=weights_version_before(schedule, micro_step),
    )


def stale_slices(schedule: Schedule, num_micro_steps: int) -> tuple[SliceUse, ...]:
    """The slice use of every micro-step ``0 .. num_micro_steps - 1``, each flagged ``stale``
    or not by the closed-form rule (filter on ``.stale`` for the stale ones)."""
    _require_non_negative_int("num_micro_steps", num_micro_steps)
    return tuple(slice_use(schedule, t) for t in range(num_micro_steps))


def last_use_of_slice(schedule: Schedule, rollout: int, slice_index: int) -> int:
    """The micro-step of slice ``slice_index``'s final use (epoch ``num_iterations - 1``)."""
    last_epoch_start = schedule.steps_per_generation - schedule.slices_per_rollout
    return generation_micro_step(schedule, rollout) + last_epoch_start + slice_index


def slice_needs_recompute(schedule: Schedule, rollout: int, slice_index: int) -> bool:
    """True iff some use of the slice is stale; staleness is monotone within a rollout, so
    checking the last use suffices."""
    return slice_use(schedule, last_use_of_slice(schedule, rollout, slice_index)).stale


def recompute_slices(schedule: Schedule, rollout: int) -> tuple[int, ...]:
    """Slices of rollout ``rollout`` whose old logprobs must be recomputed up front."""
    _require_non_negative_int("rollout", rollout)
    return tuple(
        k for k in range(schedule.slices_per_rollout) if slice_needs_recompute(schedule, rollout, k)
    )


# --------------------------------------------------------------------------------------------
# Config, facts and gates
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateConfig:
    """The ``planner.*`` gate modes."""

    old_log_prob: OldLogProbMode = OldLogProbMode.AUTO
    """``planner.old_log_prob``: "auto" recomputes only stale slices; "always" every slice;
    "rollout" uses the engine's sampled logprobs (an approximation); "never" forces the
    training forward's logprobs and is allowed only on an on-policy schedule."""

    ref_log_prob: RefLogProbMode = RefLogProbMode.AUTO
    """``planner.ref_log_prob``: "auto" runs the reference forward only while a KL
    coefficient is non-zero; "always" every step; "never" is forbidden while one is non-zero."""

    def __post_init__(self) -> None:
        old_mode = _parse_mode("planner.old_log_prob", OldLogProbMode, self.old_log_prob)
        ref_mode = _parse_mode("planner.ref_log_prob", RefLogProbMode, self.ref_log_prob)
        object.__setattr__(self, "old_log_prob", old_mode)
        object.__setattr__(self, "ref_log_prob", ref_mode)


@dataclass(frozen=True)
class RunFacts:
    """What is known at start-up, before any step runs."""

    modes: GateConfig
    """The ``planner.*`` gate modes."""

    schedule: Schedule
    """The micro-step schedule."""

    num_steps: int
    """Number of RL steps (rollouts) in the run; scheduled coefficients are checked over it."""

    kl_coef: Coef = 0.0
    """``actor.kl_coef``: KL-loss coefficient, a constant or ``step -> value``."""

    kl_reward_coef: Coef = 0.0
    """``algo.kl_reward_coef``: reward KL-penalty coefficient, a constant or ``step -> value``."""

    lora_enabled: bool = False
    """``actor.lora.rank > 0``: only adapters train, the base weights stay the initial model's."""

    def __post_init__(self) -> None:
        _require_non_negative_int("trainer.num_steps", self.num_steps)
        _require_coef("actor.kl_coef", self.kl_coef)
        _require_coef("algo.kl_reward_coef", self.kl_reward_coef)


@dataclass(frozen=True)
class StepFacts:
    """Everything :func:`decide_gates` needs about one RL step; nothing else is consulted."""

    step: int
    """RL step index, which is also the index of the rollout generated for it."""

    schedule: Schedule
    """The micro-step schedule."""

    slices: int | tuple[tuple[int, ...], ...]
    """Sequences per slice (slice ``k`` holds ``k*n .. k*n+n-1``), or the explicit
    slice -> sequence-indices mapping, one tuple per slice of the rollout."""

    modes: GateConfig = field(default_factory=GateConfig)
    """The ``planner.*`` gate modes."""

    kl_coef: Coef = 0.0
    """``actor.kl_coef``: this step's value, or the whole schedule ``step -> value``."""

    kl_reward_coef: Coef = 0.0
    """``algo.kl_reward_coef``: this step's value, or the whole schedule ``step -> value``."""

    lora_enabled: bool = False
    """Whether the actor trains a LoRA adapter on frozen base weights."""

    engine_base_weights_resident: bool | None = None
    """The rollout engine's own report: does it still hold the base weights (did not sleep,
    or slept at a level that keeps them)? Required with LoRA; ignored without."""

    def __post_init__(self) -> None:
        _require_non_negative_int("step", self.step)
        _require_coef("actor.kl_coef", self.kl_coef)
        _require_coef("algo.kl_reward_coef", self.kl_reward_coef)
        if self.lora_enabled and self.engine_base_weights_resident is None:
            raise ValueError(
                "engine_base_weights_resident must come from the engine's report when "
                "LoRA is enabled (it is never inferred from config)"
            )
        if not isinstance(self.slices, int):
            object.__setattr__(self, "slices", tuple(tuple(s) for s in self.slices))
        _check_slices(self.slices, self.schedule)

    @property
    def slice_seq_indices(self) -> tuple[tuple[int, ...], ...]:
        """The slice -> sequence-indices mapping, expanded from a count if needed."""
        if isinstance(self.slices, int):
            n = self.slices
            return tuple(
                tuple(range(k * n, (k + 1) * n)) for k in range(self.schedule.slices_per_rollout)
            )
        return self.slices

    @property
    def num_sequences(self) -> int:
        """Sequences in this step's rollout."""
        return sum(len(s) for s in self.slice_seq_indices)


@dataclass(frozen=True)
class PassGate:
    """Whether one expensive pass runs, on which sequences, and why."""

    run: bool
    """Whether the pass runs at all this step."""

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


@dataclass(frozen=True)
class StepGates:
    """The decisions for one RL step; workers execute these and nothing else."""

    step: int
    """RL step (rollout) the gates are for."""

    num_sequences: int
    """Sequences in the rollout, the denominator of ``gates/old_log_prob_frac``."""

    old_log_prob: PassGate
    """Old-logprob forward; must run before the first optimizer step after generation."""

    ref_log_prob: PassGate
    """Reference-model logprob forward."""

    base_weight_sync: PassGate
    """Sync of base (or, without LoRA, full) weights to the rollout engine."""

    adapter_sync: PassGate
    """Sync of the LoRA adapter to the rollout engine."""

    def old_log_prob_source_of(self, seq_index: int) -> OldLogProbSource:
        """Where sequence ``seq_index``'s old logprobs come from."""
        if self.old_log_prob.source is OldLogProbSource.ROLLOUT:
            return OldLogProbSource.ROLLOUT
        if seq_index in self.old_log_prob.seq_indices:
            return OldLogProbSource.RECOMPUTE
        return OldLogProbSource.TRAIN_FORWARD

    def metrics(self) -> dict[str, float | str]:
        """Per-step metrics, exactly the four ``gates/*`` keys."""
        return {
            "gates/old_log_prob_frac": len(self.old_log_prob.seq_indices) / self.num_sequences,
            "gates/ref_log_prob": float(self.ref_log_prob.run),
            "gates/base_weight_sync": float(self.base_weight_sync.run),
            "gates/reasons": "; ".join(
                [
                    f"old_lp: {self.old_log_prob.reason}",
                    f"ref: {self.ref_log_prob.reason}",
                    f"sync: {self.base_weight_sync.reason}",
                ]
            ),
        }

    def summary(self) -> str:
        """One console line, e.g. ``old_lp: 8/16 recompute (mb1 after step) | ref: skip
        (kl_coef=0, kl_reward_coef=0) | sync: adapter only (engine kept base)``."""
        return " | ".join(
            [
                f"old_lp: {self._old_log_prob_action()} ({self.old_log_prob.reason})",
                f"ref: {'run' if self.ref_log_prob.run else 'skip'} ({self.ref_log_prob.reason})",
                f"sync: {self._sync_action()} ({self.base_weight_sync.reason})",
            ]
        )

    def _old_log_prob_action(self) -> str:
        if self.old_log_prob.source is OldLogProbSource.ROLLOUT:
            return "rollout logprobs"
        return f"{len(self.old_log_prob.seq_indices)}/{self.num_sequences} recompute"

    def _sync_action(self) -> str:
        if not self.adapter_sync.run:
            return "full weights"
        return "base + adapter" if self.base_weight_sync.run else "adapter only"


# --------------------------------------------------------------------------------------------
# Start-up checks
# --------------------------------------------------------------------------------------------


def validate_gate_config(run: RunFacts) -> None:
    """Raise :class:`GateConfigError` at start-up for a forced choice that would be wrong."""
    problems = _unsafe_old_log_prob(run.modes, run.schedule)
    for step in range(run.num_steps):
        ref_problems = _unsafe_ref_log_prob(run.modes, run.kl_coef, run.kl_reward_coef, step)
        if ref_problems:
            problems += ref_problems  # the first offending step is enough to name
            break
    if problems:
        raise GateConfigError("; ".join(problems))


def needs_reference_model(run: RunFacts) -> PassGate:
    """Whether to build the reference model at all: not when no step of the run needs it."""
    mode = run.modes.ref_log_prob
    if mode is RefLogProbMode.ALWAYS:
        return PassGate(run=True, reason="planner.ref_log_prob=always")
    if mode is RefLogProbMode.NEVER:
        return PassGate(run=False, reason="planner.ref_log_prob=never")
    for step in range(run.num_steps):
        kl_terms = _nonzero_kl_terms(run.kl_coef, run.kl_reward_coef, step)
        if kl_terms:
            return PassGate(run=True, reason=f"{kl_terms} at step {step}")
    return PassGate(run=False, reason=f"kl_coef=0, kl_reward_coef=0 for all {run.num_steps} steps")


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
class ReferencePlan:
    source: ReferenceSource
    reason: str


def decide_reference(run: RunFacts) -> ReferencePlan:
    """Build a reference model only when some step needs reference logprobs and LoRA cannot
    provide them from the actor's own frozen base weights."""
    needed = needs_reference_model(run)
    if not needed.run:
        return ReferencePlan(ReferenceSource.NONE, f"no reference model: {needed.reason}")
    if run.lora_enabled:
        return ReferencePlan(
            ReferenceSource.ACTOR_WITHOUT_ADAPTERS,
            f"reference = actor with LoRA adapters disabled ({needed.reason})",
        )
    return ReferencePlan(ReferenceSource.MODEL, f"reference model built ({needed.reason})")


def _unsafe_old_log_prob(modes: GateConfig, schedule: Schedule) -> list[str]:
    if modes.old_log_prob is not OldLogProbMode.NEVER or schedule.is_on_policy:
        return []
    return [
        f"planner.old_log_prob=never is unsafe with {schedule.off_policy_settings()}: slices "
        f"are consumed after an optimizer step; use 'auto'"
    ]


def _unsafe_ref_log_prob(
    modes: GateConfig, kl_coef: Coef, kl_reward_coef: Coef, step: int
) -> list[str]:
    kl_terms = _nonzero_kl_terms(kl_coef, kl_reward_coef, step)
    if modes.ref_log_prob is not RefLogProbMode.NEVER or not kl_terms:
        return []
    return [f"planner.ref_log_prob=never is unsafe with {kl_terms} at step {step}"]


# --------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------


def decide_gates(facts: StepFacts) -> StepGates:
    """Decide every expensive pass of one RL step from its facts alone."""
    problems = _unsafe_old_log_prob(facts.modes, facts.schedule) + _unsafe_ref_log_prob(
        facts.modes, facts.kl_coef, facts.kl_reward_coef, facts.step
    )
    if problems:
        raise GateConfigError("; ".join(problems))
    base_weight_sync, adapter_sync = decide_weight_sync(
        facts.lora_enabled, facts.engine_base_weights_resident
    )
    return StepGates(
        step=facts.step,
        num_sequences=facts.num_sequences,
        old_log_prob=decide_old_log_prob(facts),
        ref_log_prob=decide_ref_log_prob(facts),
        base_weight_sync=base_weight_sync,
        adapter_sync=adapter_sync,
    )


def decide_old_log_prob(facts: StepFacts) -> PassGate:
    """Old-logprob forward: per slice under "auto", everything or nothing otherwise."""
    mode = facts.modes.old_log_prob
    if mode is OldLogProbMode.ROLLOUT:
        return PassGate(
            run=False,
            source=OldLogProbSource.ROLLOUT,
            reason="planner.old_log_prob=rollout: engine logprobs, an approximation whose "
            "price rollout/logprob_abs_diff shows",
        )
    if mode is OldLogProbMode.NEVER:
        return _train_forward_gate("planner.old_log_prob=never, on-policy schedule")
    all_seqs = tuple(sorted(i for s in facts.slice_seq_indices for i in s))
    if mode is OldLogProbMode.ALWAYS:
        return _recompute_gate(all_seqs, "planner.old_log_prob=always")
    stale = recompute_slices(facts.schedule, facts.step)
    if not stale:
        return _train_forward_gate("on-policy")
    seqs = tuple(sorted(i for k in stale for i in facts.slice_seq_indices[k]))
    return _recompute_gate(seqs, f"{_slice_labels(stale)} after step")


def decide_ref_log_prob(facts: StepFacts) -> PassGate:
    """Reference forward: while a KL coefficient is non-zero at this step (or forced)."""
    all_seqs = tuple(sorted(i for s in facts.slice_seq_indices for i in s))
    mode = facts.modes.ref_log_prob
    if mode is RefLogProbMode.ALWAYS:
        return PassGate(run=True, seq_indices=all_seqs, reason="planner.ref_log_prob=always")
    if mode is RefLogProbMode.NEVER:
        return PassGate(run=False, reason="planner.ref_log_prob=never")
    kl_terms = _nonzero_kl_terms(facts.kl_coef, facts.kl_reward_coef, facts.step)
    if kl_terms:
        source = " (actor without adapters)" if facts.lora_enabled else ""
        return PassGate(run=True, seq_indices=all_seqs, reason=kl_terms + source)
    return PassGate(run=False, reason="kl_coef=0, kl_reward_coef=0")


def decide_weight_sync(
    lora_enabled: bool, engine_base_weights_resident: bool | None
) -> tuple[PassGate, PassGate]:
    """(base-weight sync, adapter sync), from the engine's report, never from config."""
    if not lora_enabled:
        return (
            PassGate(run=True, reason="no LoRA: full weights"),
            PassGate(run=False, reason="no LoRA"),
        )
    adapter = PassGate(run=True, reason="LoRA adapter")
    if engine_base_weights_resident:
        return PassGate(run=False, reason="engine kept base"), adapter
    return PassGate(run=True, reason="engine freed base"), adapter


def _recompute_gate(seq_indices: tuple[int, ...], reason: str) -> PassGate:
    return PassGate(
        run=True, seq_indices=seq_indices, source=OldLogProbSource.RECOMPUTE, reason=reason
    )


def _train_forward_gate(reason: str) -> PassGate:
    return PassGate(run=False, source=OldLogProbSource.TRAIN_FORWARD, reason=reason)


def _slice_labels(slice_indices: tuple[int, ...]) -> str:
    """Compact labels for sorted slices: (0, 1, 2, 5) -> "mb0-2,mb5"."""
    runs: list[list[int]] = []
    for k in slice_indices:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ",".join(f"mb{r[0]}" if len(r) == 1 else f"mb{r[0]}-{r[-1]}" for r in runs)


# --------------------------------------------------------------------------------------------
# Small validation helpers
# --------------------------------------------------------------------------------------------


def coef_at(key: str, coef: Coef, step: int) -> float:
    """The value of coefficient ``key`` at ``step``; a schedule must return a value >= 0."""
    value = coef(step) if callable(coef) else coef
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{key} must be a number >= 0, got {value!r} at step {step}")
    return float(value)


def _nonzero_kl_terms(kl_coef: Coef, kl_reward_coef: Coef, step: int) -> str:
    """E.g. "actor.kl_coef=0.1" for the KL coefficients non-zero at ``step`` ("" if none)."""
    terms = [
        f"{key}={value:g}"
        for key, value in (
            ("actor.kl_coef", coef_at("actor.kl_coef", kl_coef, step)),
            ("algo.kl_reward_coef", coef_at("algo.kl_reward_coef", kl_reward_coef, step)),
        )
        if value > 0
    ]
    return ", ".join(terms)


def _parse_mode(key: str, enum_type: type[Enum], value: object) -> Enum:
    try:
        return enum_type(value)
    except ValueError:
        choices = [m.value for m in enum_type]
        raise ValueError(f"{key} must be one of {choices}, got {value!r}") from None


def _require_coef(key: str, coef: Coef) -> None:
    if not callable(coef):
        coef_at(key, coef, step=0)


def _require_positive_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an int >= 1, got {value!r}")


def _require_non_negative_int(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an int >= 0, got {value!r}")


def _check_slices(slices: int | tuple[tuple[int, ...], ...], schedule: Schedule) -> None:
    if isinstance(slices, int):
        _require_positive_int("slices (sequences per slice)", slices)
        return
    if len(slices) != schedule.slices_per_rollout:
        raise ValueError(
            f"slices maps {len(slices)} slices but the schedule splits each rollout into "
            f"{schedule.slices_per_rollout} (steps_per_generation / num_iterations)"
        )
    flat = [i for s in slices for i in s]
    if not all(slices) or len(set(flat)) != len(flat) or min(flat) < 0:
        raise ValueError("slices must be non-empty, disjoint, non-negative sequence indices")

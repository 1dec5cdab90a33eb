"""Per-step pass gates: which expensive passes an RL step runs, on which sequences, and why.

:func:`decide_gates` is a pure function of one step's facts (:class:`StepFacts`, which
:mod:`megarl.config.planning` builds from the config, the step's plan and the rollout
engine's report) and returns :class:`StepGates`, one :class:`PassGate` per pass, each with a
reason. Workers only execute the gates; no skip decision lives inline in GPU code. At start-up
:func:`validate_gate_config` rejects forced modes that would be wrong and
:func:`decide_reference` decides once where reference logprobs come from.

* **Old-logprob forward** (the PPO ratio's behaviour-policy logprobs). A rollout is consumed as
  slices in order (the mini-batches, or the runs of them the plan merged into one optimizer
  step), repeated ``actor.ppo_epochs`` times, and every slice ends in an optimizer step. Only
  the first slice of the first epoch therefore trains on the weights that generated the rollout;
  there the training forward's detached logprobs *are* the old logprobs. Under
  ``planner.old_log_prob=auto`` every other slice is recomputed up front, before the first
  optimizer step, for exactly its sequences. Rollout correction (``algo.rollout_correction``)
  compares these old logprobs with the engine's, so they must be the trainer's own: the
  recomputed ones or, on the first slice, the training forward's (the same weights, so the same
  numbers: no extra pass is needed there either); ``planner.old_log_prob=rollout`` would make
  the engine's logprobs "old" and the correction the identity, so start-up refuses it.

  **Whole sequences, one source each.** A slice is a set of sequence indices, and every layer
  below keeps a sequence whole: the planner packs whole sequences into micro-batches (a
  sequence over the token budget runs alone, never split), the recompute pass's micro-batches
  likewise, and the loss sees one row per sequence, packed or not (``to_rows``). The gate
  names sequences, so a sequence's old logprobs come from one source for all its tokens: all
  recomputed, or all the training forward's. That is what sequence-level quantities need:
  GSPO's ratio (``actor.policy_loss=gspo``) is the geometric mean of ``pi / pi_old`` over the
  whole response, and the sequence-level IS and rejection of the rollout correction use the
  product over it. The policy loss is therefore no fact of the gate: every loss gets the same
  decision (``tests/unit/test_gates_from_plan.py`` checks it for GSPO on packed plans).

  **Stale sequences** (asynchronous training, :mod:`megarl.planner.staleness`). A sequence with
  a token sampled by older weights than the trainer's (its oldest *behaviour version* below the
  trainer's) needs, as its old logprobs, the *proximal* policy of decoupled PPO: the trainer's
  weights at the start of the step, against which PPO clips, while the rollout correction
  weighs each token by ``pi_prox / pi_behaviour`` (the engine's logprobs are the behaviour
  policy's). The first slice's training forward runs on exactly those weights, so there it
  *is* the proximal policy, stale or not, and only the slices trained after an optimizer step
  are recomputed: the rule above, unchanged. Versions change what the loss weighs, never which
  forwards run; the reason names them (``train forward (proximal; behaviour version 6 <
  trainer 7)``).

  **Router replay R2** (``actor.router_replay.mode=R2``, mixture-of-experts) replays in every
  training forward the experts the trainer's router picked in the old-logprob pass, so under
  "auto" that pass runs on every sequence, the on-policy first slice included, and says so.
* **Reference forward**: only while ``actor.kl_coef`` is non-zero or the KL is in the reward
  (``algo.use_kl_in_reward``). Its source (none, a frozen model copy, or the LoRA actor with
  its adapters disabled) is decided at start-up.
* **KL in the reward** moves both forwards before the advantages: the reward needs
  ``KL(old || ref)`` of *every* sequence before the advantages exist, and the plan (which
  prunes by advantage) comes after them. Both gates then name every sequence; the old
  logprobs are recomputed (or, under ``planner.old_log_prob=rollout``, the engine's).
* **Teacher forward** (on-policy distillation, ``algo.distill.teacher_path``): every step, on
  every sequence, before the advantages, which it makes: each sampled token's advantage is
  minus ``log pi_old - log pi_teacher``. Like the KL in the reward it also moves the
  old-logprob forward before the plan, on every sequence (or takes the engine's logprobs under
  ``planner.old_log_prob=rollout``): the student's logprobs of the advantage are the old ones.
* **Weight sync to the rollout engine**: without LoRA the full weights; with LoRA the adapter,
  plus the base weights only when the engine *reports* it freed them (never inferred from
  config: a sleep level that keeps weights is the engine's business, not ours). Nothing at
  all when the engine is the actor's own model (``rollout.engine=megatron``): it generates
  with the parameters the optimizer just updated, adapters included.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megarl.planner.gate_results import PassGate, ReferencePlan, ReferenceSource, StepGates

ROUTER_REPLAY_R2 = "actor.router_replay.mode=R2 records the routing to replay"
"""The old-logprob gate's reason under R2."""


class GateConfigError(ValueError):
    """An unsafe forced gate choice, reported at start-up with the settings that conflict."""


class OldLogProbMode(str, Enum):
    """``planner.old_log_prob``: "auto" recomputes only slices trained after an optimizer step;
    "always" every sequence; "rollout" uses the engine's sampled logprobs (an approximation);
    "never" forces the training forward's logprobs, allowed only when every slice is on-policy."""

    AUTO = "auto"
    ALWAYS = "always"
    ROLLOUT = "rollout"
    NEVER = "never"


class RefLogProbMode(str, Enum):
    """``planner.ref_log_prob``: "auto" runs the reference forward only while a KL term needs
    it; "always" every step; "never" is forbidden while one does."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True)
class RunFacts:
    """What the config fixes for the whole run."""

    ppo_mini_batches: int
    ppo_epochs: int
    total_steps: int
    old_log_prob: OldLogProbMode = OldLogProbMode.AUTO
    ref_log_prob: RefLogProbMode = RefLogProbMode.AUTO
    kl_coef: float = 0.0
    """``actor.kl_coef``: the KL-loss coefficient; with ``kl_in_reward`` what needs reference
    logprobs."""
    kl_in_reward: bool = False
    """``algo.use_kl_in_reward``: the reward's KL needs reference and old logprobs of every
    sequence, before the advantages."""
    lora_enabled: bool = False
    """``actor.lora.rank > 0``: only adapters train, the base weights stay the initial model's."""
    rollout_correction: bool = False
    """``algo.rollout_correction`` reweights or rejects tokens by ``pi_old / pi_rollout``: the
    old logprobs must be the trainer's, never the engine's."""
    router_replay_r2: bool = False
    """``actor.router_replay.mode=R2``: the old-logprob pass records the routing every training
    forward replays, so it runs on every sequence, also on an on-policy slice."""
    rollout_engine: bool = True
    """Whether the run has a rollout engine to send weights to (``algo.objective=sft`` has
    none: its batches come from a dataset)."""
    distill: bool = False
    """``algo.distill.teacher_path`` is set: the advantages need the teacher's and the old
    logprobs of every sequence, before the plan."""
    engine_is_actor: bool = False
    """``rollout.engine=megatron``: the engine generates with the actor's own parameters (LoRA
    adapters included), so there is never anything to send it."""


@dataclass(frozen=True)
class StepFacts:
    """Everything :func:`decide_gates` needs about one RL step; nothing else is consulted."""

    run: RunFacts
    step: int
    slices: tuple[tuple[int, ...], ...]
    """The sequences each optimizer step of an epoch trains, in order: the mini-batches, or the
    runs of them the plan merged (then fewer than ``actor.ppo_mini_batches``)."""
    engine_base_weights_resident: bool | None = None
    """The rollout engine's own report: does it still hold the base weights (did not sleep, or
    slept at a level that keeps them)? Required with LoRA; ignored without."""
    behaviour_versions: tuple[int, ...] | None = None
    """Per sequence (batch order): the oldest policy version that sampled one of its tokens;
    None = the trainer's current weights sampled every sequence."""
    trainer_version: int = 0
    """The version of the weights this step trains from (``step - 1``)."""

    def __post_init__(self) -> None:
        if (
            self.run.lora_enabled
            and self.run.rollout_engine
            and self.engine_base_weights_resident is None
        ):
            raise ValueError(
                "engine_base_weights_resident must come from the engine's report when "
                "LoRA is enabled (it is never inferred from config)"
            )
        versions = self.behaviour_versions
        if versions is not None and len(versions) != len(self.all_sequences):
            raise ValueError(
                f"{len(versions)} behaviour versions for {len(self.all_sequences)} sequences"
            )
        if versions is not None and any(v > self.trainer_version for v in versions):
            raise ValueError(
                f"a behaviour version above the trainer's {self.trainer_version}: {versions}"
            )

    @property
    def stale_sequences(self) -> tuple[int, ...]:
        """The sequences with a token sampled by older weights than the trainer's, sorted."""
        if self.behaviour_versions is None:
            return ()
        return tuple(
            i for i, version in enumerate(self.behaviour_versions) if version < self.trainer_version
        )

    @property
    def all_sequences(self) -> tuple[int, ...]:
        """Every sequence of the step's rollout, sorted."""
        return tuple(sorted(i for s in self.slices for i in s))


def validate_gate_config(run: RunFacts) -> None:
    """Raise :class:`GateConfigError` at start-up for a forced choice that would be wrong."""
    if run.total_steps > 0:  # the coefficient is constant: wrong at step 0 or never
        _check_forced_modes(run, run.ppo_mini_batches, step=0)


def needs_reference_model(run: RunFacts) -> PassGate:
    """Whether to build the reference model at all: not when no step of the run needs it."""
    mode = run.ref_log_prob
    if mode is not RefLogProbMode.AUTO:
        return PassGate(
            run=mode is RefLogProbMode.ALWAYS, reason=f"planner.ref_log_prob={mode.value}"
        )
    if run.kl_in_reward and run.total_steps > 0:
        return PassGate(run=True, reason=KL_IN_REWARD)
    if run.kl_coef > 0 and run.total_steps > 0:
        return PassGate(run=True, reason=f"{_kl_term(run.kl_coef)} at step 0")
    return PassGate(run=False, reason=f"{_kl_term(0.0)} for all {run.total_steps} steps")


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


def decide_gates(facts: StepFacts) -> StepGates:
    """Decide every expensive pass of one RL step from its facts alone."""
    _check_forced_modes(facts.run, len(facts.slices), facts.step)
    base_weight_sync, adapter_sync = decide_weight_sync(
        facts.run.lora_enabled,
        facts.engine_base_weights_resident,
        facts.run.rollout_engine,
        facts.run.engine_is_actor,
    )
    return StepGates(
        step=facts.step,
        num_sequences=len(facts.all_sequences),
        old_log_prob=decide_old_log_prob(facts),
        ref_log_prob=decide_ref_log_prob(facts),
        teacher_log_prob=decide_teacher_log_prob(facts.run, facts.all_sequences),
        base_weight_sync=base_weight_sync,
        adapter_sync=adapter_sync,
    )


def decide_old_log_prob(facts: StepFacts) -> PassGate:
    """Old-logprob forward: per slice under "auto", everything or nothing otherwise.

    It decides per whole slice, so per whole sequence: a sequence is recomputed entirely or
    takes the training forward's logprobs entirely (see the module docstring), which is what
    GSPO's sequence ratio and the sequence-level rollout correction require.
    """
    mode = facts.run.old_log_prob
    if mode is OldLogProbMode.ROLLOUT:
        return PassGate.rollout(
            "planner.old_log_prob=rollout: engine logprobs, an approximation whose "
            "price rollout/logprob_abs_diff shows"
        )
    if mode is OldLogProbMode.NEVER:
        return PassGate.train_forward("planner.old_log_prob=never, on-policy schedule")
    if mode is OldLogProbMode.ALWAYS:
        return PassGate.recompute(facts.all_sequences, "planner.old_log_prob=always")
    if facts.run.kl_in_reward:
        return PassGate.recompute(facts.all_sequences, f"{KL_IN_REWARD}: all, before advantages")
    if facts.run.distill:
        return PassGate.recompute(facts.all_sequences, f"{DISTILL}: all, before advantages")
    if facts.run.router_replay_r2:
        return PassGate.recompute(facts.all_sequences, ROUTER_REPLAY_R2)
    # Only the first slice of a single epoch trains on the weights the step starts from.
    first_moved = 1 if facts.run.ppo_epochs == 1 else 0
    last = len(facts.slices) - 1
    stale = f"; {_stale_reason(facts)}" if facts.stale_sequences else ""
    if first_moved > last:
        if stale:
            return PassGate.train_forward(f"proximal{stale}")
        if facts.run.rollout_correction:
            return PassGate.train_forward(f"on-policy: {_CORRECTION_OLD}")
        return PassGate.train_forward("on-policy")
    seqs = tuple(sorted(i for s in facts.slices[first_moved:] for i in s))
    label = f"mb{first_moved}" if first_moved == last else f"mb{first_moved}-{last}"
    return PassGate.recompute(seqs, f"{label} after step{stale}")


def decide_ref_log_prob(facts: StepFacts) -> PassGate:
    """Reference forward: while the KL coefficient is non-zero (or forced)."""
    mode, kl_coef = facts.run.ref_log_prob, facts.run.kl_coef
    if mode is RefLogProbMode.ALWAYS:
        return PassGate(
            run=True, seq_indices=facts.all_sequences, reason=f"planner.ref_log_prob={mode.value}"
        )
    if mode is RefLogProbMode.NEVER:
        return PassGate(run=False, reason=f"planner.ref_log_prob={mode.value}")
    if kl_coef > 0 or facts.run.kl_in_reward:
        source = " (actor without adapters)" if facts.run.lora_enabled else ""
        reason = (KL_IN_REWARD if facts.run.kl_in_reward else _kl_term(kl_coef)) + source
        return PassGate(run=True, seq_indices=facts.all_sequences, reason=reason)
    return PassGate(run=False, reason=_kl_term(0.0))


def decide_teacher_log_prob(run: RunFacts, sequences: tuple[int, ...]) -> PassGate:
    """Teacher forward: on every sequence whenever a teacher is set, since its logprobs are
    the advantages (no setting skips it); never without one."""
    if run.distill:
        return PassGate(run=True, seq_indices=sequences, reason=DISTILL)
    return PassGate(run=False, reason="no algo.distill.teacher_path")


def decide_weight_sync(
    lora_enabled: bool,
    engine_base_weights_resident: bool | None,
    rollout_engine: bool = True,
    engine_is_actor: bool = False,
) -> tuple[PassGate, PassGate]:
    """(base-weight sync, adapter sync), from the engine's report, never from config; nothing
    when there is no engine or the engine is the actor's model."""
    skipped = _no_weight_sync(rollout_engine, engine_is_actor)
    if skipped is not None:
        return skipped
    if not lora_enabled:
        return (
            PassGate(run=True, reason="no LoRA: full weights"),
            PassGate(run=False, reason="no LoRA"),
        )
    adapter = PassGate(run=True, reason="LoRA adapter")
    if engine_base_weights_resident:
        return PassGate(run=False, reason="engine kept base"), adapter
    return PassGate(run=True, reason="engine freed base"), adapter


def decide_restore_sync(run: RunFacts) -> tuple[PassGate, PassGate]:
    """(base-weight sync, adapter sync) after a resume restored the trainer's weights: the
    engine serves the restored ones from the first rollout on, so both are sent (the adapter
    with LoRA), unless the run has no engine."""
    skipped = _no_weight_sync(run.rollout_engine, run.engine_is_actor)
    if skipped is not None:
        return skipped
    adapter = PassGate(
        run=run.lora_enabled, reason="restored adapter" if run.lora_enabled else "no LoRA"
    )
    return PassGate(run=True, reason="restored weights"), adapter


ENGINE_IS_ACTOR = "the engine is the actor's model"
"""The sync gates' reason under ``rollout.engine=megatron``."""


def _no_weight_sync(
    rollout_engine: bool, engine_is_actor: bool
) -> tuple[PassGate, PassGate] | None:
    """Both sync gates skipped, with the reason, when no engine needs weights; else None."""
    if not rollout_engine:
        reason = "no rollout engine (algo.objective=sft)"
    elif engine_is_actor:
        reason = ENGINE_IS_ACTOR
    else:
        return None
    return PassGate(run=False, reason=reason), PassGate(run=False, reason=reason)


def _check_forced_modes(run: RunFacts, num_slices: int, step: int) -> None:
    """Old "never" is safe only when the rollout is one slice trained once (nothing is trained
    after an optimizer step); reference "never" only while no KL term needs it."""
    problems = []
    epochs = run.ppo_epochs
    if run.old_log_prob is OldLogProbMode.NEVER and num_slices * epochs > 1:
        settings = ", ".join(
            f"{key}={value}"
            for key, value in (("actor.ppo_mini_batches", num_slices), ("actor.ppo_epochs", epochs))
            if value > 1
        )
        problems.append(
            f"planner.old_log_prob=never is unsafe with {settings}: slices are consumed after an "
            "optimizer step; use 'auto'"
        )
    if run.old_log_prob is OldLogProbMode.ROLLOUT and run.rollout_correction:
        problems.append(
            "planner.old_log_prob=rollout makes the engine's logprobs the old ones, so "
            "algo.rollout_correction would compare them with themselves; use 'auto'"
        )
    if run.ref_log_prob is RefLogProbMode.NEVER and run.kl_coef > 0:
        problems.append(
            f"planner.ref_log_prob=never is unsafe with {_kl_term(run.kl_coef)} at step {step}"
        )
    if run.ref_log_prob is RefLogProbMode.NEVER and run.kl_in_reward:
        problems.append(
            f"planner.ref_log_prob=never contradicts {KL_IN_REWARD}: the reward's KL needs "
            "reference logprobs"
        )
    if run.old_log_prob is OldLogProbMode.NEVER and run.kl_in_reward:
        problems.append(
            f"planner.old_log_prob=never contradicts {KL_IN_REWARD}: the reward's KL needs old "
            "logprobs before the update; use 'auto' or 'rollout'"
        )
    if run.old_log_prob is OldLogProbMode.NEVER and run.distill:
        problems.append(
            f"planner.old_log_prob=never contradicts {DISTILL}: the distillation advantage needs "
            "the student's old logprobs before the update; use 'auto' or 'rollout'"
        )
    if problems:
        raise GateConfigError("; ".join(problems))


KL_IN_REWARD = "algo.use_kl_in_reward=true"
"""The gates' reason when the KL in the reward is what runs a pass."""
DISTILL = "algo.distill"
"""The gates' reason when on-policy distillation is what runs a pass."""
_CORRECTION_OLD = "the train forward is pi_old for algo.rollout_correction"


def _stale_reason(facts: StepFacts) -> str:
    """``behaviour version 6 < trainer 7`` (or ``versions 4-6``) of the stale sequences."""
    assert facts.behaviour_versions is not None  # there are stale sequences
    versions = [facts.behaviour_versions[i] for i in facts.stale_sequences]
    low, high = min(versions), max(versions)
    shown = f"version {low}" if low == high else f"versions {low}-{high}"
    return f"behaviour {shown} < trainer {facts.trainer_version}"


def _kl_term(kl_coef: float) -> str:
    return f"actor.kl_coef={kl_coef:g}"

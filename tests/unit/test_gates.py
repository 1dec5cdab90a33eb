"""Step gates: the closed-form staleness rule against a brute-force simulation, and every gate."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megarl.planner.gates import (
    GateConfig,
    GateConfigError,
    OldLogProbMode,
    OldLogProbSource,
    PassGate,
    ReferenceSource,
    RefLogProbMode,
    RunFacts,
    Schedule,
    SliceUse,
    StepFacts,
    decide_gates,
    decide_reference,
    needs_reference_model,
    recompute_slices,
    stale_slices,
    validate_gate_config,
)


def simulate_schedule(schedule: Schedule, num_micro_steps: int) -> tuple[SliceUse, ...]:
    """Brute-force event simulation of the schedule: the oracle the rule is checked against.

    Walks micro-steps with a buffer of pending (slice, epoch) uses, generates a rollout when
    the buffer is empty, and increments a weight version at every ``grad_accum``-th backward.
    Shares no arithmetic with :func:`slice_use`.
    """
    uses: list[SliceUse] = []
    version, accumulated, rollout, generated_at_version = 0, 0, -1, 0
    pending: list[tuple[int, int]] = []
    for micro_step in range(num_micro_steps):
        if not pending:
            rollout += 1
            generated_at_version = version
            pending = [
                (k, epoch)
                for epoch in range(schedule.num_iterations)
                for k in range(schedule.slices_per_rollout)
            ]
        slice_index, epoch = pending.pop(0)
        uses.append(
            SliceUse(micro_step, rollout, slice_index, epoch, generated_at_version, version)
        )
        accumulated += 1
        if accumulated == schedule.grad_accum:
            version, accumulated = version + 1, 0
    return tuple(uses)


GRID = [
    Schedule(steps_per_generation=k * i, num_iterations=i, grad_accum=g)
    for k, i, g in itertools.product(range(1, 5), range(1, 4), range(1, 5))
]


def _horizon(schedule: Schedule) -> int:
    """Long enough to cover every phase of rollouts against optimizer steps, several times."""
    return 3 * schedule.steps_per_generation * schedule.grad_accum + schedule.steps_per_generation


def _facts(schedule: Schedule, step: int = 0, **overrides: object) -> StepFacts:
    values: dict[str, object] = {"step": step, "schedule": schedule, "slices": 8}
    values.update(overrides)
    return StepFacts(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The worked example
# ---------------------------------------------------------------------------------------------

EXAMPLE = Schedule(steps_per_generation=2, num_iterations=1, grad_accum=3)


def test_example_generation_and_optimizer_steps_from_the_simulation() -> None:
    uses = simulate_schedule(EXAMPLE, 12)
    generated_at = [u.micro_step for u in uses if u.slice_index == 0 and u.epoch == 0]
    stepped_after = [
        a.micro_step
        for a, b in zip(uses, uses[1:], strict=False)
        if b.version_at_use > a.version_at_use
    ]
    assert generated_at == [0, 2, 4, 6, 8, 10]
    assert stepped_after == [2, 5, 8]  # and after 11, past the horizon
    assert uses[-1].version_at_use == 3


def test_example_only_micro_steps_3_and_9_are_stale() -> None:
    assert [u.micro_step for u in stale_slices(EXAMPLE, 12) if u.stale] == [3, 9]
    assert [u.micro_step for u in simulate_schedule(EXAMPLE, 12) if u.stale] == [3, 9]


def test_example_two_of_six_rollouts_recompute_only_their_second_slice() -> None:
    per_rollout = [recompute_slices(EXAMPLE, r) for r in range(6)]
    assert per_rollout == [(), (1,), (), (), (1,), ()]
    assert sum(bool(s) for s in per_rollout) == 2
    # The static peer rule (TRL: grad_accum % generate_every != 0) recomputes all 6.
    assert not EXAMPLE.is_on_policy


def test_example_gate_recomputes_the_second_slice_of_rollout_1_only() -> None:
    gates = [decide_gates(_facts(EXAMPLE, step=r, slices=((0, 1), (2, 3)))) for r in range(6)]
    assert [g.old_log_prob.seq_indices for g in gates] == [(), (2, 3), (), (), (2, 3), ()]
    assert gates[1].old_log_prob_source_of(2) is OldLogProbSource.RECOMPUTE
    assert gates[1].old_log_prob_source_of(0) is OldLogProbSource.TRAIN_FORWARD


# ---------------------------------------------------------------------------------------------
# The closed-form rule against brute force
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", GRID, ids=repr)
def test_rule_matches_simulation_on_the_grid(schedule: Schedule) -> None:
    horizon = _horizon(schedule)
    assert stale_slices(schedule, horizon) == simulate_schedule(schedule, horizon)


@pytest.mark.parametrize("schedule", GRID, ids=repr)
def test_recompute_slices_match_the_simulated_stale_uses(schedule: Schedule) -> None:
    uses = simulate_schedule(schedule, _horizon(schedule))
    num_full_rollouts = len(uses) // schedule.steps_per_generation
    for rollout in range(num_full_rollouts):
        simulated = sorted({u.slice_index for u in uses if u.rollout == rollout and u.stale})
        assert list(recompute_slices(schedule, rollout)) == simulated


@pytest.mark.parametrize("schedule", GRID, ids=repr)
def test_on_policy_iff_the_simulation_never_goes_stale(schedule: Schedule) -> None:
    any_stale = any(u.stale for u in simulate_schedule(schedule, _horizon(schedule)))
    assert schedule.is_on_policy is not any_stale


@given(
    slices=st.integers(1, 8),
    iterations=st.integers(1, 5),
    grad_accum=st.integers(1, 12),
    num_micro_steps=st.integers(0, 300),
)
def test_rule_matches_simulation_for_random_schedules(
    slices: int, iterations: int, grad_accum: int, num_micro_steps: int
) -> None:
    schedule = Schedule(slices * iterations, iterations, grad_accum)
    assert stale_slices(schedule, num_micro_steps) == simulate_schedule(schedule, num_micro_steps)


def test_the_grid_comparison_catches_an_off_by_one_rule() -> None:
    """The brute-force check has teeth: shifting optimizer steps by one micro-step differs."""
    wrong = [
        SliceUse(u.micro_step, u.rollout, u.slice_index, u.epoch,
                 u.version_at_generation, (u.micro_step + 1) // EXAMPLE.grad_accum)
        for u in stale_slices(EXAMPLE, 12)
    ]  # fmt: skip
    assert tuple(wrong) != simulate_schedule(EXAMPLE, 12)


def test_slices_are_read_epoch_major() -> None:
    uses = stale_slices(Schedule.from_ppo(ppo_mini_batches=3, ppo_epochs=2), 6)
    assert [(u.epoch, u.slice_index) for u in uses] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]


# ---------------------------------------------------------------------------------------------
# megarl's PPO loop and TRL's
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mini_batches", "epochs"), list(itertools.product(range(1, 5), range(1, 4)))
)
def test_from_ppo_is_consistent(mini_batches: int, epochs: int) -> None:
    schedule = Schedule.from_ppo(mini_batches, epochs)
    assert schedule == Schedule(mini_batches * epochs, epochs, 1)
    assert schedule.slices_per_rollout == mini_batches
    uses = simulate_schedule(schedule, 3 * mini_batches * epochs)
    # One rollout per RL step, mini-batch order repeated each epoch, one optimizer step each.
    assert [u.rollout for u in uses] == [t // (mini_batches * epochs) for t in range(len(uses))]
    assert [u.version_at_use for u in uses] == list(range(len(uses)))


def test_from_trl_counts_slices_not_the_period() -> None:
    schedule = Schedule.from_trl(
        steps_per_generation=4, num_iterations=2, gradient_accumulation_steps=8
    )
    assert schedule == Schedule(steps_per_generation=8, num_iterations=2, grad_accum=8)
    assert schedule.is_on_policy  # TRL: 8 % (4 * 2) == 0, old logprobs not computed


def test_ppo_one_mini_batch_one_epoch_recomputes_nothing() -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(1, 1)))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.seq_indices == ()
    assert gates.old_log_prob.source is OldLogProbSource.TRAIN_FORWARD
    assert "on-policy" in gates.old_log_prob.reason
    assert gates.metrics()["gates/old_log_prob_frac"] == 0.0


@pytest.mark.parametrize("step", [0, 1, 7])
def test_ppo_two_mini_batches_recompute_only_the_second(step: int) -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(2, 1), step=step))
    assert gates.old_log_prob.run
    assert gates.old_log_prob.seq_indices == tuple(range(8, 16))
    assert gates.old_log_prob.source is OldLogProbSource.RECOMPUTE
    assert gates.old_log_prob.reason == "mb1 after step"


@pytest.mark.parametrize("mini_batches", [1, 2, 3])
def test_ppo_two_epochs_recompute_every_slice(mini_batches: int) -> None:
    schedule = Schedule.from_ppo(mini_batches, 2)
    uses = stale_slices(schedule, 2 * mini_batches)
    assert all(u.stale for u in uses if u.epoch == 1)  # everything from epoch 2 on
    assert [u.stale for u in uses if u.epoch == 0] == [False] + [True] * (mini_batches - 1)
    gates = decide_gates(_facts(schedule, step=3))
    assert gates.old_log_prob.seq_indices == tuple(range(8 * mini_batches))


def test_explicit_slice_mapping_selects_those_sequences() -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(3, 1), slices=((5, 0), (4, 1), (3, 2))))
    assert gates.old_log_prob.seq_indices == (1, 2, 3, 4)
    assert gates.old_log_prob.reason == "mb1-2 after step"
    assert gates.metrics()["gates/old_log_prob_frac"] == pytest.approx(4 / 6)


# ---------------------------------------------------------------------------------------------
# Old-logprob modes
# ---------------------------------------------------------------------------------------------


def test_always_recomputes_every_sequence_even_on_policy() -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(1, 1), modes=GateConfig(old_log_prob="always")))
    assert gates.old_log_prob.seq_indices == tuple(range(8))
    assert gates.old_log_prob.source is OldLogProbSource.RECOMPUTE
    assert gates.metrics()["gates/old_log_prob_frac"] == 1.0


def test_rollout_mode_uses_engine_logprobs_and_names_the_price() -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(2, 2), modes=GateConfig(old_log_prob="rollout")))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.source is OldLogProbSource.ROLLOUT
    assert gates.old_log_prob_source_of(3) is OldLogProbSource.ROLLOUT
    assert "approximation" in gates.old_log_prob.reason
    assert "rollout/logprob_abs_diff" in gates.old_log_prob.reason
    assert gates.metrics()["gates/old_log_prob_frac"] == 0.0
    assert gates.summary().startswith("old_lp: rollout logprobs (")


def test_never_on_an_on_policy_schedule_uses_the_train_forward() -> None:
    schedule = Schedule(steps_per_generation=2, num_iterations=1, grad_accum=4)
    gates = decide_gates(_facts(schedule, slices=4, modes=GateConfig(old_log_prob="never")))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.source is OldLogProbSource.TRAIN_FORWARD


# ---------------------------------------------------------------------------------------------
# Reference logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kl_coef", "kl_reward_coef", "expected_run", "reason"),
    [
        (0.0, 0.0, False, "kl_coef=0, kl_reward_coef=0"),
        (0.1, 0.0, True, "actor.kl_coef=0.1"),
        (0.0, 0.05, True, "algo.kl_reward_coef=0.05"),
        (0.1, 0.05, True, "actor.kl_coef=0.1, algo.kl_reward_coef=0.05"),
    ],
)
def test_ref_auto_runs_only_with_a_kl_term(
    kl_coef: float, kl_reward_coef: float, expected_run: bool, reason: str
) -> None:
    gates = decide_gates(
        _facts(Schedule.from_ppo(1, 1), kl_coef=kl_coef, kl_reward_coef=kl_reward_coef)
    )
    assert gates.ref_log_prob.run is expected_run
    assert gates.ref_log_prob.reason == reason
    assert gates.ref_log_prob.seq_indices == (tuple(range(8)) if expected_run else ())
    assert gates.metrics()["gates/ref_log_prob"] == float(expected_run)


def test_ref_follows_a_scheduled_coefficient() -> None:
    def warmup_kl(step: int) -> float:
        return 0.1 if step < 10 else 0.0

    runs = [
        decide_gates(_facts(Schedule.from_ppo(1, 1), step=s, kl_coef=warmup_kl)).ref_log_prob.run
        for s in (0, 9, 10, 50)
    ]
    assert runs == [True, True, False, False]


def test_ref_always_runs_with_zero_kl() -> None:
    gates = decide_gates(_facts(Schedule.from_ppo(1, 1), modes=GateConfig(ref_log_prob="always")))
    assert gates.ref_log_prob.run
    assert gates.ref_log_prob.reason == "planner.ref_log_prob=always"


def test_reference_model_not_built_when_kl_is_zero_for_the_whole_run() -> None:
    run = RunFacts(GateConfig(), Schedule.from_ppo(1, 1), num_steps=100)
    assert not needs_reference_model(run).run


def test_reference_model_built_when_a_scheduled_kl_turns_on_late() -> None:
    def late_kl(step: int) -> float:
        return 0.02 if step == 99 else 0.0

    gate = needs_reference_model(
        RunFacts(GateConfig(), Schedule.from_ppo(1, 1), num_steps=100, kl_reward_coef=late_kl)
    )
    assert gate.run
    assert gate.reason == "algo.kl_reward_coef=0.02 at step 99"
    shorter = RunFacts(GateConfig(), Schedule.from_ppo(1, 1), num_steps=99, kl_reward_coef=late_kl)
    assert not needs_reference_model(shorter).run


@pytest.mark.parametrize(
    ("kl_coef", "lora", "source"),
    [
        (0.0, False, ReferenceSource.NONE),
        (0.0, True, ReferenceSource.NONE),
        (0.01, False, ReferenceSource.MODEL),
        (0.01, True, ReferenceSource.ACTOR_WITHOUT_ADAPTERS),
    ],
)
def test_reference_source(kl_coef: float, lora: bool, source: ReferenceSource) -> None:
    """LoRA never builds a second model: its frozen base is the reference."""
    run = RunFacts(
        GateConfig(), Schedule.from_ppo(1, 1), num_steps=3, kl_coef=kl_coef, lora_enabled=lora
    )
    plan = decide_reference(run)
    assert plan.source is source
    assert ("kl_coef=0.01" in plan.reason) is (kl_coef > 0), plan.reason


@pytest.mark.parametrize(("mode", "expected"), [("always", True), ("never", False)])
def test_reference_model_forced(mode: str, expected: bool) -> None:
    run = RunFacts(GateConfig(ref_log_prob=mode), Schedule.from_ppo(1, 1), num_steps=3)
    assert needs_reference_model(run).run is expected


# ---------------------------------------------------------------------------------------------
# Weight sync
# ---------------------------------------------------------------------------------------------


FULL = "no LoRA: full weights"


@pytest.mark.parametrize(
    ("lora", "resident", "base", "adapter", "reason", "summary"),
    [
        (False, None, True, False, FULL, f"sync: full weights ({FULL})"),
        (False, True, True, False, FULL, f"sync: full weights ({FULL})"),
        (False, False, True, False, FULL, f"sync: full weights ({FULL})"),
        (True, True, False, True, "engine kept base", "sync: adapter only (engine kept base)"),
        (True, False, True, True, "engine freed base", "sync: base + adapter (engine freed base)"),
    ],
)
def test_weight_sync_truth_table(
    lora: bool, resident: bool | None, base: bool, adapter: bool, reason: str, summary: str
) -> None:
    gates = decide_gates(
        _facts(Schedule.from_ppo(1, 1), lora_enabled=lora, engine_base_weights_resident=resident)
    )
    assert gates.base_weight_sync.run is base
    assert gates.adapter_sync.run is adapter
    assert gates.base_weight_sync.reason == reason
    assert gates.summary().endswith(summary)
    assert gates.metrics()["gates/base_weight_sync"] == float(base)


def test_lora_requires_the_engines_report() -> None:
    with pytest.raises(ValueError, match="engine_base_weights_resident"):
        _facts(Schedule.from_ppo(1, 1), lora_enabled=True)


# ---------------------------------------------------------------------------------------------
# Forced-unsafe choices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "settings"),
    [
        (Schedule.from_ppo(2, 1), ["actor.ppo_mini_batches=2"]),
        (Schedule.from_ppo(1, 2), ["actor.ppo_epochs=2"]),
        (Schedule.from_ppo(3, 2), ["actor.ppo_mini_batches=3", "actor.ppo_epochs=2"]),
        (EXAMPLE, ["schedule.steps_per_generation=2", "schedule.grad_accum=3"]),
        (Schedule.from_trl(2, 1, 1), ["steps_per_generation=2", "gradient_accumulation_steps=1"]),
    ],
)
def test_old_never_on_an_off_policy_schedule_names_both_settings(
    schedule: Schedule, settings: list[str]
) -> None:
    run = RunFacts(GateConfig(old_log_prob="never"), schedule, num_steps=1)
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(run)
    for expected in ["planner.old_log_prob=never", *settings]:
        assert expected in str(err.value)
    with pytest.raises(GateConfigError, match="planner.old_log_prob=never"):
        decide_gates(_facts(schedule, modes=GateConfig(old_log_prob="never"), slices=1))


@pytest.mark.parametrize(
    ("coefs", "named"),
    [
        ({"kl_coef": 0.1}, "actor.kl_coef=0.1 at step 0"),
        ({"kl_reward_coef": 0.3}, "algo.kl_reward_coef=0.3 at step 0"),
        ({"kl_coef": lambda step: 0.1 if step >= 5 else 0.0}, "actor.kl_coef=0.1 at step 5"),
    ],
)
def test_ref_never_with_a_kl_term_names_both_settings(coefs: dict, named: str) -> None:
    run = RunFacts(GateConfig(ref_log_prob="never"), Schedule.from_ppo(1, 1), 10, **coefs)
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(run)
    assert "planner.ref_log_prob=never" in str(err.value)
    assert named in str(err.value)


def test_every_forced_combination_errors_exactly_when_unsafe() -> None:
    schedules = [Schedule.from_ppo(1, 1), Schedule.from_ppo(2, 1), Schedule.from_ppo(1, 2),
                 EXAMPLE, Schedule(2, 1, 4)]  # fmt: skip
    for old, ref, schedule, kl_coef, kl_reward in itertools.product(
        OldLogProbMode, RefLogProbMode, schedules, [0.0, 0.1], [0.0, 0.2]
    ):
        modes = GateConfig(old_log_prob=old, ref_log_prob=ref)
        run = RunFacts(modes, schedule, 2, kl_coef=kl_coef, kl_reward_coef=kl_reward)
        unsafe_old = old is OldLogProbMode.NEVER and not schedule.is_on_policy
        unsafe_ref = ref is RefLogProbMode.NEVER and (kl_coef > 0 or kl_reward > 0)
        if not (unsafe_old or unsafe_ref):
            validate_gate_config(run)
            continue
        with pytest.raises(GateConfigError) as err:
            validate_gate_config(run)
        message = str(err.value)
        if unsafe_old:
            assert "planner.old_log_prob=never" in message
            assert schedule.off_policy_settings()
            assert schedule.off_policy_settings() in message
        if unsafe_ref:
            assert "planner.ref_log_prob=never" in message
            assert ("actor.kl_coef=0.1" if kl_coef else "algo.kl_reward_coef=0.2") in message


# ---------------------------------------------------------------------------------------------
# Metrics, summary and validation
# ---------------------------------------------------------------------------------------------


def test_metrics_have_exactly_the_four_keys_and_values() -> None:
    gates = decide_gates(
        _facts(
            Schedule.from_ppo(2, 1),
            kl_coef=0.1,
            lora_enabled=True,
            engine_base_weights_resident=False,
        )
    )
    assert gates.metrics() == {
        "gates/old_log_prob_frac": 0.5,
        "gates/ref_log_prob": 1.0,
        "gates/base_weight_sync": 1.0,
        "gates/reasons": "old_lp: mb1 after step; ref: actor.kl_coef=0.1 (actor without adapters); sync: engine freed base",
    }


def test_summary_line() -> None:
    gates = decide_gates(
        _facts(Schedule.from_ppo(2, 1), lora_enabled=True, engine_base_weights_resident=True)
    )
    assert gates.summary() == (
        "old_lp: 8/16 recompute (mb1 after step) | ref: skip (kl_coef=0, kl_reward_coef=0) "
        "| sync: adapter only (engine kept base)"
    )


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: Schedule(0), "schedule.steps_per_generation"),
        (lambda: Schedule(2, 0), "schedule.num_iterations"),
        (lambda: Schedule(2, 1, 0), "schedule.grad_accum"),
        (lambda: Schedule(3, 2), "schedule.num_iterations=2"),
        (lambda: Schedule.from_ppo(0, 1), "actor.ppo_mini_batches"),
        (lambda: Schedule.from_ppo(1, 0), "actor.ppo_epochs"),
        (lambda: GateConfig(old_log_prob="sometimes"), "planner.old_log_prob"),
        (lambda: GateConfig(ref_log_prob="maybe"), "planner.ref_log_prob"),
        (lambda: _facts(Schedule.from_ppo(1, 1), kl_coef=-0.1), "actor.kl_coef"),
        (lambda: _facts(Schedule.from_ppo(2, 1), slices=((0, 1),)), "slices"),
        (lambda: _facts(Schedule.from_ppo(2, 1), slices=((0, 1), (1, 2))), "disjoint"),
        (lambda: _facts(Schedule.from_ppo(1, 1), slices=0), "slices"),
        (lambda: RunFacts(GateConfig(), Schedule(1), num_steps=-1), "trainer.num_steps"),
        (lambda: PassGate(run=False, reason="x", seq_indices=(1,)), "cannot name sequences"),
    ],
)
def test_invalid_values_name_the_config_key(build: Callable[[], object], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build()


def test_scheduled_negative_coefficient_is_rejected_at_its_step() -> None:
    with pytest.raises(ValueError, match="actor.kl_coef must be a number >= 0, got -1.0 at step 3"):
        decide_gates(_facts(Schedule.from_ppo(1, 1), step=3, kl_coef=lambda step: -step / 3))

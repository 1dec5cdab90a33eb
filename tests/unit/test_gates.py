"""Step gates: the old-logprob rule against a simulation of the PPO loop, and every gate."""

from __future__ import annotations

import itertools

import pytest

from megarl.planner.gate_results import OldLogProbSource, PassGate, ReferenceSource
from megarl.planner.gates import (
    GateConfigError,
    OldLogProbMode,
    RefLogProbMode,
    RunFacts,
    StepFacts,
    decide_gates,
    decide_reference,
    needs_reference_model,
    validate_gate_config,
)

SEQS_PER_SLICE = 8


def _run(mini_batches: int = 1, epochs: int = 1, total_steps: int = 3, **overrides: object):
    return RunFacts(mini_batches, epochs, total_steps, **overrides)  # type: ignore[arg-type]


def _facts(
    mini_batches: int = 1,
    epochs: int = 1,
    step: int = 0,
    slices: tuple[tuple[int, ...], ...] | None = None,
    engine_base_weights_resident: bool | None = None,
    **run_overrides: object,
) -> StepFacts:
    if slices is None:
        n = SEQS_PER_SLICE
        slices = tuple(tuple(range(k * n, (k + 1) * n)) for k in range(mini_batches))
    return StepFacts(
        _run(len(slices), epochs, **run_overrides),  # type: ignore[arg-type]
        step,
        slices,
        engine_base_weights_resident,
    )


def simulate_stale_slices(mini_batches: int, epochs: int) -> set[int]:
    """Brute-force walk of the PPO loop, the oracle the gate is checked against: slices in order,
    every epoch, one optimizer step after each; a slice is stale if any of its uses comes after
    an optimizer step that followed the rollout's generation. Shares no arithmetic with the gate.
    """
    optimizer_steps, stale = 0, set()
    for _epoch in range(epochs):
        for k in range(mini_batches):
            if optimizer_steps > 0:
                stale.add(k)
            optimizer_steps += 1
    return stale


# ---------------------------------------------------------------------------------------------
# Old logprobs under "auto"
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mini_batches", "epochs"), list(itertools.product(range(1, 5), range(1, 4)))
)
def test_recomputed_sequences_match_the_simulated_stale_slices(
    mini_batches: int, epochs: int
) -> None:
    gates = decide_gates(_facts(mini_batches, epochs))
    stale = simulate_stale_slices(mini_batches, epochs)
    n = SEQS_PER_SLICE
    assert gates.old_log_prob.seq_indices == tuple(
        i for k in sorted(stale) for i in range(k * n, (k + 1) * n)
    )
    assert gates.old_log_prob.run is bool(stale)


def test_ppo_one_mini_batch_one_epoch_recomputes_nothing() -> None:
    gates = decide_gates(_facts(1, 1))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.seq_indices == ()
    assert gates.old_log_prob.source is OldLogProbSource.TRAIN_FORWARD
    assert "on-policy" in gates.old_log_prob.reason
    assert gates.metrics()["gates/old_log_prob_frac"] == 0.0


@pytest.mark.parametrize("step", [0, 1, 7])
def test_ppo_two_mini_batches_recompute_only_the_second(step: int) -> None:
    gates = decide_gates(_facts(2, 1, step=step))
    assert gates.old_log_prob.run
    assert gates.old_log_prob.seq_indices == tuple(range(8, 16))
    assert gates.old_log_prob.source is OldLogProbSource.RECOMPUTE
    assert gates.old_log_prob.reason == "mb1 after step"


@pytest.mark.parametrize("mini_batches", [1, 2, 3])
def test_ppo_two_epochs_recompute_every_slice(mini_batches: int) -> None:
    gates = decide_gates(_facts(mini_batches, 2, step=3))
    assert gates.old_log_prob.seq_indices == tuple(range(8 * mini_batches))


def test_explicit_slice_mapping_selects_those_sequences() -> None:
    gates = decide_gates(_facts(slices=((5, 0), (4, 1), (3, 2))))
    assert gates.old_log_prob.seq_indices == (1, 2, 3, 4)
    assert gates.old_log_prob.reason == "mb1-2 after step"
    assert gates.metrics()["gates/old_log_prob_frac"] == pytest.approx(4 / 6)


# ---------------------------------------------------------------------------------------------
# Old-logprob modes
# ---------------------------------------------------------------------------------------------


def test_always_recomputes_every_sequence_even_on_policy() -> None:
    gates = decide_gates(_facts(old_log_prob=OldLogProbMode.ALWAYS))
    assert gates.old_log_prob.seq_indices == tuple(range(8))
    assert gates.old_log_prob.source is OldLogProbSource.RECOMPUTE
    assert gates.metrics()["gates/old_log_prob_frac"] == 1.0


def test_rollout_mode_uses_engine_logprobs_and_names_the_price() -> None:
    gates = decide_gates(_facts(2, 2, old_log_prob=OldLogProbMode.ROLLOUT))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.source is OldLogProbSource.ROLLOUT
    assert "approximation" in gates.old_log_prob.reason
    assert "rollout/logprob_abs_diff" in gates.old_log_prob.reason
    assert gates.metrics()["gates/old_log_prob_frac"] == 0.0
    assert gates.summary().startswith("old_lp: rollout logprobs (")


def test_never_with_one_mini_batch_and_epoch_uses_the_train_forward() -> None:
    gates = decide_gates(_facts(old_log_prob=OldLogProbMode.NEVER))
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.source is OldLogProbSource.TRAIN_FORWARD


# ---------------------------------------------------------------------------------------------
# Reference logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kl_coef", "expected_run", "reason"),
    [(0.0, False, "actor.kl_coef=0"), (0.1, True, "actor.kl_coef=0.1")],
)
def test_ref_auto_runs_only_with_a_kl_term(kl_coef: float, expected_run: bool, reason: str) -> None:
    gates = decide_gates(_facts(kl_coef=kl_coef))
    assert gates.ref_log_prob.run is expected_run
    assert gates.ref_log_prob.reason == reason
    assert gates.ref_log_prob.seq_indices == (tuple(range(8)) if expected_run else ())
    assert gates.metrics()["gates/ref_log_prob"] == float(expected_run)


def test_ref_always_runs_with_zero_kl() -> None:
    gates = decide_gates(_facts(ref_log_prob=RefLogProbMode.ALWAYS))
    assert gates.ref_log_prob.run
    assert gates.ref_log_prob.reason == "planner.ref_log_prob=always"


def test_reference_model_not_built_when_kl_is_zero() -> None:
    gate = needs_reference_model(_run(total_steps=100))
    assert not gate.run
    assert gate.reason == "actor.kl_coef=0 for all 100 steps"


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
    plan = decide_reference(_run(kl_coef=kl_coef, lora_enabled=lora))
    assert plan.source is source
    assert ("kl_coef=0.01" in plan.reason) is (kl_coef > 0), plan.reason


@pytest.mark.parametrize(("mode", "expected"), [("always", True), ("never", False)])
def test_reference_model_forced(mode: str, expected: bool) -> None:
    run = _run(ref_log_prob=RefLogProbMode(mode))
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
    gates = decide_gates(_facts(lora_enabled=lora, engine_base_weights_resident=resident))
    assert gates.base_weight_sync.run is base
    assert gates.adapter_sync.run is adapter
    assert gates.base_weight_sync.reason == reason
    assert gates.summary().endswith(summary)
    assert gates.metrics()["gates/base_weight_sync"] == float(base)


def test_lora_requires_the_engines_report() -> None:
    with pytest.raises(ValueError, match="engine_base_weights_resident"):
        _facts(lora_enabled=True)


# ---------------------------------------------------------------------------------------------
# Forced-unsafe choices
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mini_batches", "epochs", "settings"),
    [
        (2, 1, ["actor.ppo_mini_batches=2"]),
        (1, 2, ["actor.ppo_epochs=2"]),
        (3, 2, ["actor.ppo_mini_batches=3", "actor.ppo_epochs=2"]),
    ],
)
def test_old_never_with_an_optimizer_step_inside_the_rollout_names_both_settings(
    mini_batches: int, epochs: int, settings: list[str]
) -> None:
    never = OldLogProbMode.NEVER
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(_run(mini_batches, epochs, old_log_prob=never))
    for expected in ["planner.old_log_prob=never", *settings]:
        assert expected in str(err.value)
    with pytest.raises(GateConfigError, match="planner.old_log_prob=never"):
        decide_gates(_facts(mini_batches, epochs, old_log_prob=never))


def test_ref_never_with_a_kl_term_names_both_settings() -> None:
    run = _run(ref_log_prob=RefLogProbMode.NEVER, kl_coef=0.1)
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(run)
    assert "planner.ref_log_prob=never" in str(err.value)
    assert "actor.kl_coef=0.1 at step 0" in str(err.value)


def test_every_forced_combination_errors_exactly_when_unsafe() -> None:
    for old, ref, (mini_batches, epochs), kl_coef in itertools.product(
        OldLogProbMode, RefLogProbMode, [(1, 1), (2, 1), (1, 2)], [0.0, 0.1]
    ):
        run = _run(mini_batches, epochs, 2, old_log_prob=old, ref_log_prob=ref, kl_coef=kl_coef)
        unsafe_old = old is OldLogProbMode.NEVER and mini_batches * epochs > 1
        unsafe_ref = ref is RefLogProbMode.NEVER and kl_coef > 0
        if not (unsafe_old or unsafe_ref):
            validate_gate_config(run)
            continue
        with pytest.raises(GateConfigError) as err:
            validate_gate_config(run)
        message = str(err.value)
        if unsafe_old:
            assert "planner.old_log_prob=never" in message
            assert ("actor.ppo_mini_batches=2" if mini_batches > 1 else "actor.ppo_epochs=2") in (
                message
            )
        if unsafe_ref:
            assert "planner.ref_log_prob=never" in message
            assert "actor.kl_coef=0.1" in message


# ---------------------------------------------------------------------------------------------
# Metrics, summary and validation
# ---------------------------------------------------------------------------------------------


def test_metrics_have_exactly_the_four_keys_and_values() -> None:
    gates = decide_gates(
        _facts(2, 1, kl_coef=0.1, lora_enabled=True, engine_base_weights_resident=False)
    )
    assert gates.metrics() == {
        "gates/old_log_prob_frac": 0.5,
        "gates/ref_log_prob": 1.0,
        "gates/base_weight_sync": 1.0,
        "gates/reasons": "old_lp: mb1 after step; ref: actor.kl_coef=0.1 (actor without adapters); sync: engine freed base",
    }


def test_summary_line() -> None:
    gates = decide_gates(_facts(2, 1, lora_enabled=True, engine_base_weights_resident=True))
    assert gates.summary() == (
        "old_lp: 8/16 recompute, rest train forward (mb1 after step) | ref: skip (actor.kl_coef=0) "
        "| sync: adapter only (engine kept base)"
    )


def test_a_gate_that_does_not_run_names_no_sequences() -> None:
    with pytest.raises(ValueError, match="cannot name sequences"):
        PassGate(run=False, reason="x", seq_indices=(1,))


# ---------------------------------------------------------------------------------------------
# Rollout correction: the old logprobs must be the trainer's own
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (2, 1), (1, 2), (3, 2)])
@pytest.mark.parametrize("mode", [OldLogProbMode.AUTO, OldLogProbMode.ALWAYS])
def test_correction_never_takes_the_engines_logprobs_as_old(
    mini_batches: int, epochs: int, mode: OldLogProbMode
) -> None:
    """Every sequence's old logprobs are recomputed or come from the training forward on the
    generating weights, the same oracle as without correction; never the engine's."""
    validate_gate_config(_run(mini_batches, epochs, old_log_prob=mode, rollout_correction=True))
    gates = decide_gates(_facts(mini_batches, epochs, old_log_prob=mode, rollout_correction=True))
    assert gates.old_log_prob.source is not OldLogProbSource.ROLLOUT
    stale = simulate_stale_slices(mini_batches, epochs)
    if mode is OldLogProbMode.ALWAYS:
        stale = set(range(mini_batches))
    expected = tuple(i for k in sorted(stale) for i in range(k * 8, (k + 1) * 8))
    assert gates.old_log_prob.seq_indices == expected
    assert "rollout logprobs" not in gates.summary()


def test_correction_on_policy_says_the_train_forward_is_old() -> None:
    gates = decide_gates(_facts(rollout_correction=True))
    assert gates.old_log_prob.source is OldLogProbSource.TRAIN_FORWARD
    assert gates.old_log_prob.reason == (
        "on-policy: the train forward is pi_old for algo.rollout_correction"
    )
    assert gates.summary().startswith(
        "old_lp: train forward (on-policy: the train forward is pi_old for algo.rollout_correction)"
    )
    assert decide_gates(_facts()).old_log_prob.reason == "on-policy"


def test_correction_with_rollout_logprobs_as_old_is_refused_at_start_up() -> None:
    run = _run(old_log_prob=OldLogProbMode.ROLLOUT, rollout_correction=True)
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(run)
    message = str(err.value)
    assert "planner.old_log_prob=rollout" in message and "algo.rollout_correction" in message
    assert "\n" not in message
    validate_gate_config(_run(old_log_prob=OldLogProbMode.ROLLOUT))  # no correction: allowed
    validate_gate_config(_run(old_log_prob=OldLogProbMode.NEVER, rollout_correction=True))


@pytest.mark.parametrize(
    ("recomputed_slices", "action"),
    [(0, "train forward"), (1, "8/16 recompute, rest train forward"), (2, "16/16 recompute")],
)
def test_summary_names_which_logprobs_are_old(recomputed_slices: int, action: str) -> None:
    mode = {0: OldLogProbMode.NEVER, 1: OldLogProbMode.AUTO, 2: OldLogProbMode.ALWAYS}
    mini_batches = 1 if recomputed_slices == 0 else 2
    gates = decide_gates(_facts(mini_batches, old_log_prob=mode[recomputed_slices]))
    assert gates.summary().startswith(f"old_lp: {action} (")


def test_a_resume_sends_the_restored_weights_unless_there_is_no_engine():
    from megarl.planner.gates import decide_restore_sync

    base, adapter = decide_restore_sync(RunFacts(1, 1, 3, lora_enabled=True))
    assert base.run and adapter.run
    base, adapter = decide_restore_sync(RunFacts(1, 1, 3))
    assert base.run and not adapter.run
    base, adapter = decide_restore_sync(RunFacts(1, 1, 3, lora_enabled=True, rollout_engine=False))
    assert not base.run and not adapter.run and "no rollout engine" in base.reason


def test_nothing_is_sent_to_an_engine_that_is_the_actors_model():
    """``rollout.engine=megatron``: no sync at any step or after a resume, LoRA or not, whatever
    the engine reports, and the gates' line says why."""
    from megarl.planner.gate_results import StepGates
    from megarl.planner.gates import ENGINE_IS_ACTOR, decide_restore_sync

    for lora in (False, True):
        run = RunFacts(1, 1, 3, lora_enabled=lora, engine_is_actor=True)
        gates: StepGates = decide_gates(
            StepFacts(run, step=1, slices=((0, 1),), engine_base_weights_resident=True)
        )
        assert not gates.base_weight_sync.run and not gates.adapter_sync.run
        assert f"sync: skip ({ENGINE_IS_ACTOR})" in gates.summary()
        base, adapter = decide_restore_sync(run)
        assert not base.run and not adapter.run and base.reason == ENGINE_IS_ACTOR


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_rollout_side_megatron_engine_is_synced_like_any_copy(lora):
    """``rollout.engine=megatron`` with split placement holds a copy of the weights on the
    rollout side: the full weights (or, with LoRA, the adapter into the base it keeps) are sent,
    and the gates' line says which."""
    from megarl.config.planning import run_facts
    from megarl.config.schema import build_run_config

    tree: dict = {"rollout": {"engine": "megatron", "n_gpus": 1}, "trainer": {"launcher": "ray"}}
    if lora:
        tree["actor"] = {"lora": {"rank": 4, "alpha": 8}}
    run = run_facts(build_run_config(tree))
    assert not run.engine_is_actor
    gates = decide_gates(
        StepFacts(run, step=1, slices=((0, 1),), engine_base_weights_resident=True)
    )
    if lora:
        assert not gates.base_weight_sync.run and gates.adapter_sync.run
        assert "sync: adapter only (engine kept base)" in gates.summary()
    else:
        assert gates.base_weight_sync.run and not gates.adapter_sync.run
        assert "sync: full weights (no LoRA: full weights)" in gates.summary()

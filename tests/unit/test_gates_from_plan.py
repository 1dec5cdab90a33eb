"""Old-logprob gates judge staleness on the optimizer steps the plan executes.

``planner.prune_zero_adv=fast`` merges baseline mini-batches into fewer optimizer steps; a
sequence trained in the rollout's first optimizer step is on-policy even though the unmerged
schedule would have trained it after a step. Plain data only: config -> plan -> gates.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megarl.config import planning
from megarl.config.schema import build_run_config
from megarl.planner.batch_planner import plan_step
from megarl.planner.gate_results import OldLogProbSource
from megarl.planner.gates import decide_gates
from megarl.planner.inputs import LossTerms
from megarl.planner.micro_batches import plan_forward_micro_batches

SEQ_TOKENS = [10] * 16
RESPONSE_TOKENS = [4] * 16
GROUPS = [i // 4 for i in range(16)]


def _gates(mode: str, mini_batches: int, advantages: list[float], epochs: int = 1):
    cfg = build_run_config(
        {
            "actor": {"ppo_mini_batches": mini_batches, "ppo_epochs": epochs},
            "planner": {"prune_zero_adv": mode},
        }
    )
    plan = plan_step(planning.planner_inputs(cfg, SEQ_TOKENS, RESPONSE_TOKENS, advantages, GROUPS))
    facts = planning.step_facts(cfg, 1, len(SEQ_TOKENS), plan=plan)
    return plan, decide_gates(facts)


def _groups_kept(*kept: bool) -> list[float]:
    """Group g of 4 sequences has advantages (+1, -1, +1, -1) if kept, else all 0."""
    return [(1.0 if i % 2 == 0 else -1.0) if kept[i // 4] else 0.0 for i in range(16)]


def test_fast_merged_into_one_step_recomputes_nothing():
    plan, gates = _gates("fast", 4, _groups_kept(True, False, False, False))
    assert [s.source_mini_batches for s in plan.optimizer_steps] == [(0, 1, 2, 3)]
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.reason == "on-policy"


def test_fast_two_runs_recompute_the_second_runs_sequences():
    plan, gates = _gates("fast", 4, _groups_kept(True, False, True, False))
    assert [s.source_mini_batches for s in plan.optimizer_steps] == [(0, 1), (2, 3)]
    # unmerged, mini-batch 1 (sequences 4-7) would count as trained after a step
    assert gates.old_log_prob.seq_indices == tuple(range(8, 16))


@pytest.mark.parametrize("mode", ["off", "match_loss_curve"])
def test_unmerged_modes_use_the_baseline_mini_batches(mode):
    _, gates = _gates(mode, 4, _groups_kept(True, False, False, False))
    assert gates.old_log_prob.seq_indices == tuple(range(4, 16))


def test_fast_with_two_epochs_recomputes_for_the_second_epoch():
    plan, gates = _gates("fast", 2, _groups_kept(True, False, False, False), epochs=2)
    assert [s.source_mini_batches for s in plan.optimizer_steps] == [(0, 1), (0, 1)]
    assert gates.old_log_prob.seq_indices == tuple(range(16))


def test_a_critics_unpruned_plan_keeps_the_baseline_old_and_ref_gates():
    """With algo.adv_estimator=gae the planner never prunes, so the old-logprob gate sees the
    baseline mini-batches (only the first is on-policy) and the reference gate is the
    KL terms' business alone, whatever the per-sequence advantages look like."""
    cfg = build_run_config({"actor": {"ppo_mini_batches": 4}})
    advantages = _groups_kept(True, False, False, False)
    inputs = planning.planner_inputs(cfg, SEQ_TOKENS, RESPONSE_TOKENS, advantages, GROUPS)
    plan = plan_step(replace(inputs, mode="off", loss_terms=LossTerms(adv_estimator="gae")))
    assert plan.num_kept_sequences == 16
    gates = decide_gates(planning.step_facts(cfg, 1, len(SEQ_TOKENS), plan=plan))
    assert gates.old_log_prob.seq_indices == tuple(range(4, 16))
    assert not gates.ref_log_prob.run


# ---------------------------------------------------------------------------------------------
# GSPO: a sequence ratio needs the whole sequence's old logprobs, from one source
# ---------------------------------------------------------------------------------------------

GSPO_SEQ_TOKENS = [7, 30, 12, 5, 26, 9, 14, 3, 21, 8, 11, 40, 6, 17, 10, 4]
"""Varied lengths, some over the 24-token micro-batch budget (those run alone, unsplit)."""
GSPO_RESPONSE_TOKENS = [max(1, n // 2) for n in GSPO_SEQ_TOKENS]


def _trained_positions(plan) -> dict[int, set[int]]:
    """Brute force over the executed plan, sharing nothing with the gate: for each sequence,
    the optimizer steps (0 = the rollout's first) that train it at loss weight 1."""
    positions: dict[int, set[int]] = {}
    for position, opt_step in enumerate(plan.optimizer_steps):
        for rank in opt_step.ranks:
            for mb in rank.micro_batches:
                for i, weight in zip(mb.seq_indices, mb.loss_weights, strict=True):
                    if weight == 1.0:
                        positions.setdefault(i, set()).add(position)
    return positions


def _assert_steps_hold_whole_sequences(plan, slices) -> None:
    """Every micro-batch carries whole sequences (its token count is their full lengths),
    a step trains a sequence in one micro-batch only, and all of a step within one slice."""
    for opt_step in plan.optimizer_steps:
        trained: list[int] = []
        for rank in opt_step.ranks:
            for mb in rank.micro_batches:
                assert mb.num_tokens == sum(GSPO_SEQ_TOKENS[i] for i in mb.seq_indices)
                trained += [i for i, w in zip(mb.seq_indices, mb.loss_weights, strict=True) if w]
        assert len(trained) == len(set(trained)), "a sequence split over micro-batches"
        assert any(set(trained) <= set(s) for s in slices), "a step straddles two windows"


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize(("mini_batches", "epochs"), [(1, 1), (2, 1), (4, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("mode", ["off", "match_loss_curve", "fast"])
@pytest.mark.parametrize(
    "kept", [(True, True, True, True), (True, False, True, False), (True, False, False, False)]
)
def test_gspo_old_logprobs_are_whole_sequences_from_one_source(
    kept: tuple[bool, ...], mode: str, mini_batches: int, epochs: int, dp: int
) -> None:
    """Under actor.policy_loss=gspo, on packed plans: the old-logprob windows (slices) split
    no sequence, and each sequence's old logprobs come from the training forward exactly when
    every step training it is the rollout's first optimizer step, else from the recompute
    pass (which also packs whole sequences). The decision is the vanilla loss's."""
    overrides = {
        "actor": {
            "policy_loss": "gspo",
            "ppo_mini_batches": mini_batches,
            "ppo_epochs": epochs,
            "micro_batch_tokens": 24,
        },
        "planner": {"prune_zero_adv": mode},
        "trainer": {"n_gpus_per_node": dp},
    }
    cfg = build_run_config(overrides)
    assert cfg.loss_agg == "seq-mean-token-mean"
    inputs = planning.planner_inputs(
        cfg, GSPO_SEQ_TOKENS, GSPO_RESPONSE_TOKENS, _groups_kept(*kept), GROUPS
    )
    plan = plan_step(inputs)
    facts = planning.step_facts(cfg, 1, len(GSPO_SEQ_TOKENS), plan=plan)
    slices = facts.slices
    flat = [i for s in slices for i in s]
    assert sorted(flat) == list(range(len(GSPO_SEQ_TOKENS))), "a sequence in two windows"
    _assert_steps_hold_whole_sequences(plan, slices)
    gate = decide_gates(facts).old_log_prob
    assert gate.source is not OldLogProbSource.ROLLOUT
    recomputed = set(gate.seq_indices)
    for i, positions in _trained_positions(plan).items():
        on_policy = positions == {0}
        assert (i not in recomputed) is on_policy, f"sequence {i} trained at steps {positions}"
    budget = cfg.actor.logprob_micro_batch_tokens
    groups = plan_forward_micro_batches(sorted(recomputed), GSPO_SEQ_TOKENS, budget)
    assert sorted(i for g in groups for i in g) == sorted(recomputed)
    vanilla = build_run_config(
        {**overrides, "actor": {**overrides["actor"], "policy_loss": "vanilla"}}
    )
    assert decide_gates(planning.step_facts(vanilla, 1, 16, plan=plan)).old_log_prob == gate

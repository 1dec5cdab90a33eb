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
from megarl.planner.gates import decide_gates

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
    plan = plan_step(replace(inputs, mode="off", adv_estimator="gae"))
    assert plan.num_kept_sequences == 16
    gates = decide_gates(planning.step_facts(cfg, 1, len(SEQ_TOKENS), plan=plan))
    assert gates.old_log_prob.seq_indices == tuple(range(4, 16))
    assert not gates.ref_log_prob.run

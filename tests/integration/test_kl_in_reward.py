"""KL in the reward, end to end on the tiny model: the adaptive ``beta`` follows the formula
from the KL each step reports, and a resumed run continues the checkpointed ``beta``.

Ziegler et al. (2019), eq. 2, as verl: ``beta' = beta * (1 + clip(kl / target - 1, -0.2, 0.2)
* responses / horizon)``; a small horizon makes each step's change large enough to see.
"""

from __future__ import annotations

import json

import pytest
from helpers.runs import tiny_overrides

from megarl.train import run

KL = {
    "algo.use_kl_in_reward": "true",
    "algo.kl_penalty": "k3",  # >= 0 per token, > 0 once the actor moved: whatever was sampled
    "algo.kl_ctrl.type": "adaptive",
    "algo.kl_ctrl.kl_coef": 0.05,
    "algo.kl_ctrl.target_kl": 0.001,
    "algo.kl_ctrl.horizon": 16,
    "trainer.save_interval": 2,
}
RESPONSES = 8  # 2 prompts x 4 samples (tiny_overrides)


def _next_beta(beta: float, kl: float) -> float:
    error = min(max(kl / 0.001 - 1, -0.2), 0.2)
    return beta * (1 + error * RESPONSES / 16)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_two_steps(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    first, second = rows
    # Step 1: the actor is the reference, so the reward's KL is exactly 0 and beta falls 10 %.
    assert first["critic/kl"] == 0.0
    assert first["critic/kl_coef"] == 0.05
    assert second["critic/kl_coef"] == pytest.approx(_next_beta(0.05, 0.0), rel=1e-12)
    assert second["critic/kl_coef"] == pytest.approx(0.045, rel=1e-12)
    assert second["critic/kl"] > 0.0, "one optimizer step moved the actor away from the reference"
    for row in rows:
        assert row["actor/reward_kl_penalty_coeff"] == row["critic/kl_coef"]
        assert "algo.use_kl_in_reward=true" in row["gates/reasons"]
        assert row["gates/ref_log_prob"] == 1.0 and row["gates/old_log_prob_frac"] == 1.0


def test_adaptive_beta_follows_the_formula_and_survives_a_resume(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run(tiny_overrides(run_dir, 2, **KL))
    _check_two_steps(_rows(run_dir))
    second = _rows(run_dir)[1]

    # Resume from the step-2 checkpoint: step 3's beta is the update from step 2's KL, which
    # only the checkpointed controller knows (a fresh one would start again at 0.05).
    run(tiny_overrides(run_dir, 3, **KL))
    third = _rows(run_dir)[-1]
    assert third["step"] == 3
    expected = _next_beta(second["critic/kl_coef"], second["critic/kl"])
    assert third["critic/kl_coef"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_data_parallel_ranks_exchange_the_precomputed_logprobs(tmp_path) -> None:
    """DP=2: the forwards run on the unpruned split, then each sequence's logprobs go to the
    rank the pruned plan gives it; the rank loop refuses a step where one is missing."""
    run_dir = tmp_path / "run"
    run(tiny_overrides(run_dir, 2, **{**KL, "trainer.n_gpus_per_node": 2}))
    _check_two_steps(_rows(run_dir))

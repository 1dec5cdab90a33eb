"""PPO with a critic (``recipe=ppo``: ``algo.adv_estimator=gae``) end to end on the tiny model,
two ranks.

Two data-parallel ranks: the critic's values are computed on an unpruned split and gathered,
GAE runs on rank 0 over the whole batch, each rank gets the targets of the sequences it
trains, and the critic and the actor are updated. Every ``critic/*`` metric is reported and
finite, and the planner says why it does not prune.
"""

from __future__ import annotations

import json
import math

from helpers.models import tiny_llama_hf_config, value_model_folder
from helpers.runs import tiny_overrides

from megarl.train import run

PPO = {
    "recipe": "ppo",
    "algo.lam": 0.95,
    "critic.lr": 1e-3,
    "critic.value_head_init_std": 0.02,
    "trainer.n_gpus_per_node": 2,
}
CRITIC_METRICS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/vf_explained_var",
    "critic/returns/mean",
    "critic/values/mean",
    "critic/advantages/mean",
    "critic/grad_norm",
    "timing_s/values",
    "timing_s/update_critic",
)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ppo_steps_report_finite_critic_metrics(tmp_path) -> None:
    """One sample per prompt, PPO's usual setting (the critic is the baseline, no group)."""
    run_dir = tmp_path / "run"
    one_each = {"rollout.n": 1, "data.prompts_per_step": 8}
    history = run(tiny_overrides(run_dir, 2, **PPO, **one_each)).history
    rows = _rows(run_dir)
    assert [r["step"] for r in history] == [1, 2]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in CRITIC_METRICS:
            assert key in row, key
            assert math.isfinite(row[key]), (key, row[key])
        assert "no pruning: algo.adv_estimator=gae" in row["planner/summary"]
        assert row["planner/kept_seq_frac"] == 1.0
        # whitened over the batch's tokens: mean 0 (up to float32)
        assert abs(row["critic/advantages/mean"]) < 1e-5
    # the critic learned something between the steps: its values moved
    assert rows[0]["critic/values/mean"] != rows[1]["critic/values/mean"]


def test_ppo_with_the_kl_in_the_reward_at_tp2(tmp_path) -> None:
    """TP=2 (one DP rank): the critic's head is replicated on both TP ranks; GAE reads the
    KL-penalised token rewards. At step 1 the actor is the reference, so the KL is ~0 (at
    TP=2 not exactly: ~6e-8, the same with grpo) and the returns lie within the outcome
    rewards' range; at step 2 it is not."""
    run_dir = tmp_path / "run"
    overrides = {
        **PPO,
        "actor.tp": 2,
        "algo.use_kl_in_reward": "true",
        "algo.kl_ctrl.kl_coef": 0.1,
    }
    run(tiny_overrides(run_dir, 2, **overrides))
    first, second = _rows(run_dir)
    for row in (first, second):
        for key in CRITIC_METRICS:
            assert math.isfinite(row[key]), (key, row[key])
    assert first["critic/kl"] < 1e-6
    assert first["critic/rewards/min"] - 1e-6 <= first["critic/returns/min"]
    assert first["critic/returns/max"] <= first["critic/rewards/max"] + 1e-6
    assert second["critic/kl"] > 1e-4


def test_the_critic_runs_its_own_mini_batches_and_epochs(tmp_path) -> None:
    """critic.ppo_mini_batches=2 and critic.ppo_epochs=2 against the actor's 1 and 1 on two DP
    ranks: the two plans split the batch differently, and each rank receives the sequences and
    targets of both. Four critic steps: the later ones move the values off the rollout's, so
    the value clip can act (a tight cliprange_value makes it)."""
    run_dir = tmp_path / "run"
    overrides = {
        **PPO,
        "critic.ppo_mini_batches": 2,
        "critic.ppo_epochs": 2,
        "critic.cliprange_value": 1e-4,
    }
    run(tiny_overrides(run_dir, 1, **overrides))
    [row] = _rows(run_dir)
    for key in CRITIC_METRICS:
        assert math.isfinite(row[key]), (key, row[key])
    assert row["critic/vf_clipfrac"] > 0.0


def test_the_critic_starts_from_critic_model_path(tmp_path, capsys) -> None:
    """``critic.model.path`` names a value model with a scalar head: rank 0 says the critic
    starts from it, and step 1's values are its head's, not the zero head that
    ``critic.value_head_init_std=0`` gives a critic from the actor's checkpoint."""
    folder = tmp_path / "value_model"
    value_model_folder(folder, tiny_llama_hf_config(), seed=5)
    run_dir = tmp_path / "run"
    overrides = {
        **PPO,
        "trainer.n_gpus_per_node": 1,
        "critic.value_head_init_std": 0.0,
        "critic.model.path": folder,
        "trainer.log_console": "true",
    }
    run(tiny_overrides(run_dir, 1, **overrides))
    where = f"critic.model.path={folder}"
    line = f"critic: trunk from {where}, value head from {where} (score.weight)"
    assert line in capsys.readouterr().out
    [row] = _rows(run_dir)
    assert row["critic/values/mean"] != 0.0
    for key in CRITIC_METRICS:
        assert math.isfinite(row[key]), (key, row[key])


def test_ppo_over_multi_turn_trajectories(tmp_path) -> None:
    """A critic over agent trajectories (``agent_loops:TwoTurns``: two generated turns around an
    8-token observation): values of every response token, GAE over the generated ones only
    (unit-tested against the trajectory with its observations cut out), and both models train."""
    run_dir = tmp_path / "run"
    overrides = {
        **PPO,
        "trainer.n_gpus_per_node": 1,
        "rollout.agent.loop": "agent_loops:TwoTurns",
        "rollout.max_new_tokens": 40,
    }
    history = run(tiny_overrides(run_dir, 2, **overrides)).history
    for row in history:
        for key in CRITIC_METRICS:
            assert math.isfinite(row[key]), (key, row[key])
        assert row["agent/num_turns/mean"] == 2.0 and row["agent/observation_tokens/mean"] == 8.0
        assert row["rollout/logprob_abs_diff"] <= 1e-4
        assert abs(row["critic/advantages/mean"]) < 1e-5  # whitened over generated tokens
    assert history[0]["critic/values/mean"] != history[1]["critic/values/mean"]
    assert any(row["actor/grad_norm"] > 0 for row in history)

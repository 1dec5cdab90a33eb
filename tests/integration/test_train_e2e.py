"""End-to-end GRPO runs through `megarl.train.run` on real Megatron ranks (CPU/gloo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.runs import REQUIRED_METRICS, tiny_overrides

from megarl.train import run
from megarl.trainer.metrics import step_line

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _read_png(path: Path) -> bytes:
    """``summary.png``, which every run that ends normally writes: a real, non-trivial PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, (path, len(data))
    return data


def _assert_rollout_correction_is_identity(row: dict) -> None:
    """fp32 on CPU: the engine and the trainer agree, so pi_old / pi_rollout ~ 1."""
    assert abs(row["rollout_corr/kl"]) <= 1e-4, row
    assert abs(row["rollout_corr/rollout_is_max"] - 1) <= 1e-3, row
    assert abs(row["rollout_corr/rollout_is_min"] - 1) <= 1e-3, row


def test_single_process_run_writes_every_metric_and_syncs_the_moved_policy(tmp_path, capsys):
    """lr 5e-2 moves the policy far in step 1, so step 2's logprobs match the trainer only if
    the weight sync really reached the engine (a silent failure would show a large diff).
    With the console on and ``trainer.progress=false`` the console prints each step's lines
    and nothing of the live display."""
    overrides = {
        "trainer.tensorboard": "true",
        "actor.lr": 5e-2,
        "trainer.log_console": "true",
        "trainer.progress": "false",
    }
    result = run(tiny_overrides(tmp_path / "run", steps=2, **overrides))
    rows = _read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    printed = capsys.readouterr().out.splitlines()
    for row in rows:  # the lines of each step, in order, as step_line writes them
        lines = step_line(row).splitlines()
        start = printed.index(lines[0])
        assert printed[start : start + len(lines)] == lines
    assert not any("GRPO" in line or "optimizer steps" in line for line in printed)
    for row in rows:
        missing = [k for k in REQUIRED_METRICS if k not in row]
        assert not missing, missing
        assert row["rollout/logprob_abs_diff"] <= 1e-3
        _assert_rollout_correction_is_identity(row)
        assert 0.0 <= row["critic/advantages/zero_adv_ratio"] <= 1.0
    assert len(result.history) == 2
    assert result.history[0]["actor/grad_norm"] > 0
    assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_tp2_pp2_four_processes_engine_agrees_with_trainer(tmp_path):
    """The 4-process TP=2 x PP=2 run: after every weight sync the engine matches the trainer."""
    result = run(
        tiny_overrides(
            tmp_path / "run",
            steps=2,
            **{"actor.tp": 2, "actor.pp": 2, "trainer.n_gpus_per_node": 4},
        )
    )
    for row in result.history:
        assert row["rollout/logprob_abs_diff"] <= 1e-3, row
        _assert_rollout_correction_is_identity(row)  # reduced over TP / PP / DP ranks
    # the second step's rollout used weights synced after step 1's update
    assert result.history[1]["actor/grad_norm"] > 0


@pytest.mark.parametrize(
    "algo",
    [
        {"algo.adv_estimator": "rloo"},
        {"algo.adv_estimator": "reinforce_plus_plus"},
        {"algo.adv_estimator": "reinforce_plus_plus_baseline"},
        {"algo.adv_estimator": "grpo", "algo.norm_adv_by_std_in_grpo": "false"},
    ],
    ids=["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo_no_std_by_flag"],
)
def test_advantage_estimator_trains_two_steps(tmp_path, algo):
    """Each estimator runs through rollout, planner and update; all of these subtract a baseline
    (group or batch mean) from every sequence, so the batch's advantages average to 0."""
    result = run(tiny_overrides(tmp_path / "run", steps=2, **algo))
    assert [r["step"] for r in result.history] == [1, 2]
    for row in result.history:
        assert math.isfinite(row["actor/pg_loss"]), row
        assert abs(row["critic/advantages/mean"]) < 1e-5, row
        assert row["critic/advantages/min"] <= 0.0 <= row["critic/advantages/max"], row


def test_dapo_recipe_trains_only_groups_with_signal(tmp_path):
    """recipe=dapo end to end: dynamic sampling fills each step with groups whose rewards
    differ (so no advantage is 0) and the overlong shaping reaches the rewards."""
    [row] = run(tiny_overrides(tmp_path / "run", steps=1, recipe="dapo")).history
    assert row["critic/advantages/zero_adv_ratio"] == 0.0, row
    assert row["train/num_gen_batches"] >= 1
    assert row["critic/rewards/overlong_penalty"] <= 0.0
    assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0


def test_trains_on_verl_parquet_rows(tmp_path):
    """The shipped GSM8K sample in verl's schema, as a verl user points at it."""
    data = REPO / "examples" / "data" / "gsm8k" / "train.parquet"
    overrides = {"data.train_files": str(data), "model.hf_config.max_position_embeddings": 512}
    [row] = run(tiny_overrides(tmp_path / "run", steps=1, **overrides)).history
    assert row["prompt_length/mean"] > 40  # GSM8K questions in the chat template, not arithmetic
    assert row["actor/grad_norm"] >= 0 and math.isfinite(row["actor/pg_loss"])


def test_validation_reports_scores_and_leaves_training_bitwise_the_same(tmp_path):
    """Validation samples from its own seed on the synced weights: the run with it (before
    training too) trains to the same parameters as the run without, and reports verl's
    val-core/val-aux keys. ``val_before_train`` logs the initial weights' scores as step 0, and a
    resume does not validate before training again."""
    val = tmp_path / "val.jsonl"
    rows = [
        {"prompt": f"What is {a} + {a}?", "reward_model": {"ground_truth": str(2 * a)}}
        for a in range(5)
    ]
    val.write_text("\n".join(json.dumps(r) for r in rows))
    plain = run(tiny_overrides(tmp_path / "plain", steps=3), return_final_state=True)
    validation = {
        "data.val_files": str(val),
        "trainer.val_interval": 2,
        "rollout.val.n": 2,
        "trainer.val_before_train": "true",
        "trainer.save_interval": 3,
    }
    validated = run(
        tiny_overrides(tmp_path / "val", steps=3, **validation), return_final_state=True
    )
    assert validated.final_state.keys() == plain.final_state.keys()
    for name, tensor in plain.final_state.items():
        assert torch.equal(tensor, validated.final_state[name]), name
    with_val = [r["step"] for r in validated.history if "val-core/unknown/reward/mean@2" in r]
    assert with_val == [2, 3]  # every 2 steps and after the last; step 0 is no training step
    row = validated.history[1]
    assert 0.0 <= row["val-aux/unknown/pass@2"] <= 1.0
    assert row["val-aux/response_length/mean"] > 0

    plot = tmp_path / "val" / "summary.png"
    first_plot = _read_png(plot)
    run(tiny_overrides(tmp_path / "val", steps=4, **validation))  # resumes from step 3
    assert _read_png(plot) != first_plot  # redrawn at the resumed run's end, with step 4
    lines = (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    initial = records[0]
    # no maj@2: the test's own reward function cannot say what a response answered
    assert sorted(initial) == [
        "step",
        "timing_s/testing",
        "val-aux/response_length/mean",
        "val-aux/unknown/pass@2",
        "val-aux/unknown/reward/best@2/mean",
        "val-aux/unknown/reward/best@2/std",
        "val-aux/unknown/reward/std@2",
        "val-aux/unknown/reward/worst@2/mean",
        "val-aux/unknown/reward/worst@2/std",
        "val-core/unknown/reward/mean@2",
    ]
    assert 0.0 <= initial["val-core/unknown/reward/mean@2"] <= 1.0
    assert "val-core/unknown/reward/mean@2" in records[4]  # the new last step


def test_the_builtin_task_validates_on_its_held_out_problems(tmp_path):
    """No data.val_files: the arithmetic task's held-out problems are the validation set, so
    the demo shows a validation curve with no download."""
    overrides = {
        "trainer.val_before_train": "true",
        "trainer.val_interval": 1,
        "data.val_problems": 8,
        "rollout.val.n": 2,
    }
    run(tiny_overrides(tmp_path / "run", steps=1, **overrides))
    records = _read_metrics(tmp_path / "run")
    assert [row["step"] for row in records] == [0, 1]
    for row in records:
        assert 0.0 <= row["val-core/unknown/reward/mean@2"] <= 1.0
        assert row["val-aux/response_length/mean"] > 0

"""Training checkpoints: exact resume, resume at another TP layout, config checks, keep_last.

Tiny model on CPU in fp32. "Exact" means bitwise-equal parameters and identical per-step
metrics between a straight run and a run that stopped, was restarted and resumed.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_overrides

from megarl.checkpoint.layout import complete_checkpoints, read_checkpoint
from megarl.train import StartupError, run

pytestmark = pytest.mark.slow

# lr 1e-4: weights move far more than 1e-6 per step, TP rounding stays far below it.
COMMON = {"actor.lr": 1e-4}
CURVE_KEYS = ("critic/rewards/mean", "actor/pg_loss")


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(rows) -> list[tuple]:
    return [(r["step"], *(r[k] for k in CURVE_KEYS)) for r in rows]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _straight(tmp_path, steps=6, **extra):
    run_dir = tmp_path / "straight"
    result = run(tiny_overrides(run_dir, steps, **{**COMMON, **extra}), return_final_state=True)
    return result.final_state, _metrics(run_dir)


def _stop_and_resume(tmp_path, first: dict, second: dict, steps=6, stop_at=3):
    run_dir = tmp_path / "resumed"
    run(tiny_overrides(run_dir, stop_at, **{**COMMON, "trainer.save_interval": stop_at, **first}))
    assert [c.step for c in complete_checkpoints(run_dir)] == [stop_at]
    result = run(tiny_overrides(run_dir, steps, **{**COMMON, "trainer.save_interval": stop_at,
                                                   **second}), return_final_state=True)
    return result, _metrics(run_dir)


def test_resume_is_bitwise_exact(tmp_path, capsys):
    straight_state, straight_rows = _straight(tmp_path)
    result, rows = _stop_and_resume(tmp_path, {}, {})
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _curve(rows) == _curve(straight_rows)
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6]
    assert any(r["actor/grad_norm"] > 0 for r in rows[3:]), "nothing trained after the resume"
    for name, tensor in straight_state.items():
        assert torch.equal(tensor, result.final_state[name]), name


def test_resume_at_another_tp_layout(tmp_path):
    straight_state, straight_rows = _straight(tmp_path)
    tp2 = {"actor.tp": 2, "trainer.n_gpus_per_node": 2}
    result, rows = _stop_and_resume(tmp_path, tp2, {})
    saved = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_000003")
    assert (saved.tp, saved.pp) == (2, 1)
    assert [r["critic/rewards/mean"] for r in rows] == [
        r["critic/rewards/mean"] for r in straight_rows]
    assert _max_diff(straight_state, result.final_state) <= 1e-6


def test_mismatched_checkpoint_is_one_line_error(tmp_path):
    run_dir = tmp_path / "run"
    run(tiny_overrides(run_dir, 1, **{"trainer.save_interval": 1}))
    with pytest.raises(StartupError) as err:
        run(tiny_overrides(run_dir, 2, **{"trainer.save_interval": 1, "trainer.seed": 7,
                                          "model.hf_config.hidden_size": 64}))
    message = str(err.value)
    assert "\n" not in message
    assert "trainer.seed: 1234 -> 7" in message
    assert "hidden_size" in message
    with pytest.raises(StartupError, match="no megarl_checkpoint.json"):
        run(tiny_overrides(run_dir, 2, **{"trainer.resume": str(tmp_path)}))


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    run(tiny_overrides(run_dir, 4, **{"trainer.save_interval": 1, "trainer.keep_last": 2,
                                      "rollout.n": 2, "data.prompts_per_step": 1}))
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000004"]

"""`trainer.launcher=ray` runs the same ranks as `local`: a 4-process TP=2 x DP=2 tiny run gives
the same per-step metrics (timings aside) under both launchers with the same seed."""

from __future__ import annotations

import pytest
from helpers.runs import tiny_overrides

from megarl.train import run

pytestmark = pytest.mark.slow

VOLATILE = ("timing_s/", "perf/")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _assert_same_metrics(a_rows: list[dict], b_rows: list[dict]) -> None:
    assert len(a_rows) == len(b_rows)
    for a_row, b_row in zip(a_rows, b_rows, strict=True):
        a, b = _comparable(a_row), _comparable(b_row)
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, (int, float)):
                assert value == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
            else:
                assert value == b[key], key


def test_ray_matches_local_tp2_dp2(tmp_path):
    layout = {"actor.tp": 2, "trainer.n_gpus_per_node": 4}
    local = run(tiny_overrides(tmp_path / "local", steps=2, **layout))
    ray_run = run(
        tiny_overrides(tmp_path / "ray", steps=2, **layout, **{"trainer.launcher": "ray"})
    )
    assert len(local.history) == 2
    _assert_same_metrics(local.history, ray_run.history)
    assert ray_run.history[0]["actor/grad_norm"] > 0


def test_split_rollout_placement_matches_colocated(tmp_path):
    """rollout.n_gpus=1: the engine in its own Ray actor gives the colocated run's metrics."""
    layout = {"actor.tp": 2, "trainer.n_gpus_per_node": 2}
    colocated = run(tiny_overrides(tmp_path / "local", steps=2, **layout))
    split = run(
        tiny_overrides(
            tmp_path / "split",
            steps=2,
            **layout,
            **{"trainer.launcher": "ray", "rollout.n_gpus": 1},
        )
    )
    _assert_same_metrics(colocated.history, split.history)
    assert split.history[1]["rollout/logprob_abs_diff"] <= 1e-3  # weights reached the engine
    assert (tmp_path / "split" / "metrics.jsonl").read_text().count("\n") == 2

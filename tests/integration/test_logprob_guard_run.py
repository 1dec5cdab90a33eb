"""The logprob guard in real runs: an engine whose weights were corrupted behind the trainer's
back (``MEGARL_FAULT_AT=0:<step>:rollout:corrupt-engine``) stops the run at that step, on every
rank, before its update, with one line; the previous checkpoint and the metrics file stay as the
step before left them, and a run without the fault resumes from there. A correct run passes the
probe after start and after every wake-up (``sync/probe_logprob_diff``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import run_env, tiny_overrides

pytestmark = pytest.mark.slow

CORRUPT_AT_2 = {"MEGARL_FAULT_AT": "0:2:rollout:corrupt-engine"}
STOP_LINE = re.compile(
    r"^megarl-train: error: .*rollout engine (?P<engine>\w+) does not run the trainer's weights: "
    r"at step 2 its logprobs differ from the trainer's by (?P<diff>[0-9.e+-]+) on average over "
    r"\d+ tokens \(rollout\.max_logprob_diff=1e-03\); last weight sync: full weights after step "
    r"1, [0-9.]+ MiB, checksum [0-9a-f]{16} \(matched the engine's\); the step's update was not "
    r"applied"
)


def _train(run_dir: Path, env: dict[str, str], **overrides) -> subprocess.CompletedProcess:
    args = tiny_overrides(run_dir, steps=3, **{"trainer.save_interval": 1, **overrides})
    return subprocess.run(
        [sys.executable, "-m", "megarl.train", *args],
        env=run_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )


def tiny_overrides_max_new_tokens() -> int:
    """The response budget of the tiny runs, which caps the probe's."""
    key = "rollout.max_new_tokens="
    [value] = [o.removeprefix(key) for o in tiny_overrides(Path("x")) if o.startswith(key)]
    return int(value)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _assert_probe_compared_its_tokens(row: dict) -> None:
    """The probe compares (nearly) its whole budget of tokens, not a few that ended at once."""
    from megarl.planner.logprob_guard import PROBE_MAX_NEW_TOKENS, PROBE_SAMPLES

    budget = PROBE_SAMPLES * min(PROBE_MAX_NEW_TOKENS, tiny_overrides_max_new_tokens())
    assert row["sync/probe_tokens"] >= 0.75 * budget, row


def _assert_stopped_at_step_2(done: subprocess.CompletedProcess, engine: str, run_dir: Path):
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("megarl-train:")]
    assert len(errors) == 1, done.stderr[-3000:]
    match = STOP_LINE.match(errors[0])
    assert match is not None, errors[0]
    assert match["engine"] == engine
    assert float(match["diff"]) > 1e-2  # rounding is ~1e-6 here: the corruption, by far
    assert [row["step"] for row in _rows(run_dir)] == [1]  # nothing of step 2 was written
    assert _checkpoints(run_dir) == ["step_000001"]


def test_corrupted_hf_engine_stops_two_ranks_and_the_run_resumes(tmp_path):
    """Two data-parallel ranks, the engine sleeping at level 2 (its weights freed and resent
    each step, so the probe runs after every wake-up): the corruption before step 2's
    generation stops both ranks before the update; without it the run resumes and finishes."""
    run_dir = tmp_path / "run"
    common = {
        "trainer.n_gpus_per_node": 2,
        "rollout.sleep_level": 2,
        "export.checksum_interval": 1,
    }
    done = _train(run_dir, CORRUPT_AT_2, **common)
    _assert_stopped_at_step_2(done, "hf", run_dir)
    [step1] = _rows(run_dir)
    assert 0 <= step1["sync/probe_logprob_diff"] <= 1e-4  # after step 1's wake and sync
    _assert_probe_compared_its_tokens(step1)
    assert step1["rollout/logprob_abs_diff"] <= 1e-4

    resumed = _train(run_dir, {}, **common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row
        assert row["sync/probe_logprob_diff"] <= 1e-4, row


def test_corrupted_vllm_engine_stops_the_run(tmp_path):
    pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    done = _train(
        run_dir, CORRUPT_AT_2, **{"rollout.engine": "vllm", "export.checksum_interval": 1}
    )
    _assert_stopped_at_step_2(done, "vllm", run_dir)
    [step1] = _rows(run_dir)
    assert 0 <= step1["sync/probe_logprob_diff"] <= 1e-4  # the probe after engine start
    _assert_probe_compared_its_tokens(step1)

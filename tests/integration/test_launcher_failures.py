"""A rank that dies mid-run (as a SIGKILL or the OOM killer would leave it) stops the run with
one line naming role, rank and node, a non-zero exit, within a bound -- under both launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DETECT_BOUND_S = 60  # death -> process exit; the collective timeout below is the backstop


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_killed_rank_is_named_and_run_exits_nonzero(tmp_path, launcher):
    mark = tmp_path / "killed_at"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
           "MEGARL_FAULT_INJECT": "1:2", "MEGARL_FAULT_INJECT_MARK": str(mark),
           "MEGARL_COLLECTIVE_TIMEOUT_S": "120"}
    args = tiny_overrides(tmp_path / "run", steps=3, **{
        "trainer.launcher": launcher, "trainer.n_gpus_per_node": 2, "actor.tp": 2})
    done = subprocess.run([sys.executable, "-m", "megarl.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    exited = time.time()
    errors = [line for line in done.stderr.splitlines() if line.startswith("megarl-train: error")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "actor rank 1 on node" in errors[0] and "failed" in errors[0], errors[0]
    detect_s = exited - float(mark.read_text())
    print(f"{launcher}: rank 1 killed -> exit in {detect_s:.1f} s: {errors[0]}")
    assert detect_s < DETECT_BOUND_S
    # whatever was recorded is whole lines (rank 0 may be stopped before it records step 1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert [r["step"] for r in rows] in ([], [1])

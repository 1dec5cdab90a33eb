"""A run's lifecycle under the local launcher: one run per run_dir, workers that die with the
launcher, and a frozen rank that is named instead of hanging the run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("megarl-train: error")]


def test_second_run_on_a_live_run_dir_is_refused(tmp_path):
    """The run_dir's lock names a live process on this host: refused with its host and pid,
    exit 2, and nothing of the run is written (no model placed, no metrics)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = {"host": socket.gethostname(), "pid": holder.pid, "pid_start": None}
        (run_dir / ".megarl.lock").write_text(json.dumps(lock))
        done = subprocess.run(
            [sys.executable, "-m", "megarl.train", *tiny_overrides(run_dir, steps=1)],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = _errors(done.stderr)
    assert f"host {socket.gethostname()}, pid {holder.pid}" in line, line
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".megarl.lock"]

"""tools/summarize_run.py reads a metrics file and refuses a broken one with file:line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "summarize_run.py"


def _row(step: int, reward: float) -> dict:
    row = {
        "step": step,
        "critic/rewards/mean": reward,
        "timing_s/step": 2.0,
        "perf/throughput": 100.0,
    }
    row.update(
        {
            f"timing_s/{p}": 0.5
            for p in ("gen", "update_actor", "old_log_prob", "ref", "adv", "update_weights")
        }
    )
    return row


def test_summary_reports_first_and_last_reward(tmp_path):
    lines = [json.dumps(_row(i, r)) for i, r in enumerate([0.1, 0.2, 0.3, 0.6, 0.7, 0.8], 1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "first 3 steps 0.200 -> last 3 steps 0.700" in out
    assert "6 steps in 12.0s" in out


def test_broken_line_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1, 0.5)) + "\n{oops\n")
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "metrics.jsonl:2:" in proc.stderr

"""tools/summarize_run.py reads a metrics file and refuses a broken one with file:line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "summarize_run.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


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


def test_prepare_data_writes_verl_rows_that_load_as_training_data(tmp_path):
    import pyarrow.parquet as pq

    from megarl.data.files import load_problem_files

    source = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "Ann has 2 cats and gets 3 more. How many?", "answer": "2+3=5\n#### 5"},
        {"question": "What is 10 x 12?", "answer": "#### 1,200"},
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out" / "train.parquet"
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "prepare_data.py"), str(source), str(out)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    first, _ = pq.read_table(out).to_pylist()
    assert first["data_source"] == "openai/gsm8k"
    assert first["reward_model"]["ground_truth"] == "5"
    assert first["prompt"][0]["content"].startswith("Ann has 2 cats and gets 3 more. How many? ")
    assert [p.answer for p in load_problem_files(str(out))] == ["5", "1200"]


def test_prepare_data_names_a_bad_row(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "no number here"}) + "\n")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "prepare_data.py"),
            str(source),
            str(tmp_path / "o.parquet"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"prepare_data: error: {source}:1: answer=")
    assert not (tmp_path / "o.parquet").exists()


def test_prepare_data_math_keeps_the_boxed_latex_answer(tmp_path):
    import pyarrow.parquet as pq

    from megarl.data.files import load_problem_files

    source = tmp_path / "math.jsonl"
    rows = [
        {"problem": "Compute $7/3 + 7/3$.", "solution": "It is $\\boxed{\\frac{14}{3}}$."},
        {"problem": "How many divisors has 196?", "solution": "$3 \\cdot 3 = \\boxed{9}$"},
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "math.parquet"
    tool = str(REPO / "tools" / "prepare_data.py")
    done = subprocess.run(
        [sys.executable, tool, str(source), str(out), "--task", "math", "--split", "test"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    first, _ = pq.read_table(out).to_pylist()
    assert first["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert first["reward_model"]["ground_truth"] == "\\frac{14}{3}"
    assert first["prompt"][0]["content"].endswith("final answer within \\boxed{}.")
    loaded = load_problem_files(str(out))  # data.reward=auto: scored by math, LaTeX kept
    assert [p.answer for p in loaded] == ["\\frac{14}{3}", "9"]

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


def _write_run(folder: Path, rewards: list[float]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_row(i, r)) for i, r in enumerate(rewards, 1)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _tool(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
    )


def test_summary_reports_first_last_and_best_reward(tmp_path):
    _write_run(tmp_path, [0.1, 0.2, 0.3, 0.6, 0.7, 0.8])
    done = _tool(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "6 steps in 12.0s, 100 tokens/s"
    assert "  reward               0.100  0.800  0.800 (step 6)" in lines
    assert "  reward, 3-step mean  0.200  0.700  0.700 (steps 4-6)" in lines
    assert "  gen             3.0s   25%    0.50s" in lines
    assert not (tmp_path / "summary.png").exists()  # only with --plot


def test_plot_writes_the_png(tmp_path):
    run = _write_run(tmp_path / "run", [0.1, 0.5])
    done = _tool(run, "--plot")
    assert done.returncode == 0, done.stderr
    assert (run / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert done.stdout.endswith(f"wrote {run / 'summary.png'}\n")
    done = _tool(run, "--plot", "--out", tmp_path / "plots" / "x.png")
    assert done.returncode == 0 and (tmp_path / "plots" / "x.png").stat().st_size > 10_000


def test_compare_prints_both_runs_and_writes_one_png(tmp_path):
    a = _write_run(tmp_path / "base", [0.1, 0.2])
    b = _write_run(tmp_path / "lora", [0.3, 0.9])
    done = _tool("--compare", a, b, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["base", "lora"]
    assert "  reward best   0.200 (step 2)  0.900 (step 2)" in lines
    assert (tmp_path / "compare_base_lora.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # two runs in folders of the same name are told apart by their parents
    c = _write_run(tmp_path / "x" / "run", [0.5])
    d = _write_run(tmp_path / "y" / "run", [0.5])
    done = _tool("--compare", c, d, "--out", tmp_path / "cd.png")
    assert done.returncode == 0 and "x/run" in done.stdout and "y/run" in done.stdout
    assert (tmp_path / "cd.png").is_file()


def test_broken_line_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1, 0.5)) + "\n{oops\n")
    proc = _tool(tmp_path)
    assert proc.returncode == 2 and "metrics.jsonl:2:" in proc.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    good = _write_run(tmp_path / "good", [0.5])
    (tmp_path / "empty").mkdir()
    (tmp_path / "list" / "metrics.jsonl").parent.mkdir()
    (tmp_path / "list" / "metrics.jsonl").write_text("[1, 2]\n")
    cases = {
        (tmp_path / "nope",): f"{tmp_path / 'nope'}: no such directory",
        (tmp_path / "empty", "--plot"): f"{tmp_path / 'empty' / 'metrics.jsonl'}: no such file",
        ("--compare", good, tmp_path / "nope"): f"{tmp_path / 'nope'}: no such directory",
        (
            tmp_path / "list",
        ): f"{tmp_path / 'list' / 'metrics.jsonl'}:1: row is a list, expected an object",
        (): "give either RUN_DIR or --compare RUN_A RUN_B",
        (good, "--compare", good, good): "give either RUN_DIR or --compare RUN_A RUN_B",
    }
    for args, message in cases.items():
        done = _tool(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr == f"summarize_run: error: {message}\n", args
    assert not list(tmp_path.glob("*.png"))


def test_prepare_data_writes_verl_rows_that_load_as_training_data(tmp_path):
    from megarl.data.files import load_problem_files

    rows = [
        {"question": "Ann has 2 cats and gets 3 more. How many?", "answer": "2+3=5\n#### 5"},
        {"question": "What is 10 x 12?", "answer": "#### 1,200"},
    ]
    out = tmp_path / "out" / "train.parquet"
    first, _ = _prepared_rows(tmp_path / "gsm8k.jsonl", rows, out)
    assert first["data_source"] == "openai/gsm8k"
    assert first["reward_model"]["ground_truth"] == "5"
    assert first["prompt"][0]["content"].startswith("Ann has 2 cats and gets 3 more. How many? ")
    assert [p.answer for p in load_problem_files(str(out))] == ["5", "1200"]


def test_prepare_data_names_a_bad_row(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "no number here"}) + "\n")
    done = _prepare_data(source, tmp_path / "o.parquet")
    assert done.returncode == 2
    assert done.stderr.startswith(f"prepare_data: error: {source}:1: answer=")
    assert not (tmp_path / "o.parquet").exists()


def test_prepare_data_math_keeps_the_boxed_latex_answer(tmp_path):
    from megarl.data.files import load_problem_files

    rows = [
        {"problem": "Compute $7/3 + 7/3$.", "solution": "It is $\\boxed{\\frac{14}{3}}$."},
        {"problem": "How many divisors has 196?", "solution": "$3 \\cdot 3 = \\boxed{9}$"},
    ]
    out = tmp_path / "math.parquet"
    first, _ = _prepared_rows(
        tmp_path / "math.jsonl", rows, out, "--task", "math", "--split", "test"
    )
    assert first["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert first["reward_model"]["ground_truth"] == "\\frac{14}{3}"
    assert first["prompt"][0]["content"].endswith("final answer within \\boxed{}.")
    loaded = load_problem_files(str(out))  # data.reward=auto: scored by math, LaTeX kept
    assert [p.answer for p in loaded] == ["\\frac{14}{3}", "9"]


def _prepared_rows(source: Path, rows: list[dict], out: Path, *options: str) -> list[dict]:
    """``rows`` written to ``source`` as JSON lines, prepared into ``out`` (which must succeed),
    and read back from the parquet file."""
    import pyarrow.parquet as pq

    source.write_text("\n".join(json.dumps(r) for r in rows))
    done = _prepare_data(source, out, *options)
    assert done.returncode == 0, done.stderr
    return pq.read_table(out).to_pylist()


def _prepare_data(source, out, *options: str) -> subprocess.CompletedProcess:
    """``tools/prepare_data.py SOURCE OUT [options]`` as a user runs it."""
    tool = str(REPO / "tools" / "prepare_data.py")
    return subprocess.run(
        [sys.executable, tool, str(source), str(out), *options],
        capture_output=True,
        text=True,
        env=ENV,
    )

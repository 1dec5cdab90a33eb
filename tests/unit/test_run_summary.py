"""The end-of-run summary table and summary.png, on synthetic metric rows."""

from __future__ import annotations

import pytest

from megarl.trainer.summary import SAVED, SCORES, TIME, compare, run_summary, summarize
from megarl.trainer.summary_plot import plot_runs, write_summary_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VAL = "val-core/gsm8k/reward/mean@2"
REWARDS = [0.1, 0.5, 0.3, 0.6, 0.9, 0.8]


def _row(step: int, reward: float) -> dict:
    """A training step's record with the keys a real one has (values chosen to check sums)."""
    return {
        "step": step,
        "critic/rewards/mean": reward,
        "critic/rewards/min": 0.0,
        "critic/rewards/max": 1.0,
        "response_length/mean": 10.0 + step,
        "rollout/logprob_abs_diff": 1e-5 * step,
        "timing_s/gen": 1.0,
        "timing_s/old_log_prob": 0.0,
        "timing_s/ref": 0.0,
        "timing_s/adv": 0.0,
        "timing_s/update_actor": 0.5,
        "timing_s/update_weights": 0.25,
        "timing_s/step": 2.0,
        "perf/throughput": 100.0 * step,
        "perf/total_num_tokens": 1000,
        "planner/kept_seq_frac": 0.5,
        "planner/kept_token_frac": 0.75,
        "planner/ghost_steps": 1.0 if step == 2 else 0.0,
        "planner/optimizer_steps": 2.0,
        "gates/old_log_prob_frac": 0.0 if step % 2 else 0.5,
        "gates/ref_log_prob": 0.0,
        "gates/base_weight_sync": 1.0,
        "planner/summary": "keep 4/8 seq",
    }


def _history(with_validation: bool = True) -> list[dict]:
    rows = [_row(step, reward) for step, reward in enumerate(REWARDS, start=1)]
    if with_validation:  # the initial weights (step 0), step 3 and the last step
        rows.insert(0, {"step": 0, VAL: 0.2, "timing_s/testing": 3.0})
        rows[3][VAL], rows[3]["timing_s/testing"] = 0.7, 1.0
        rows[6][VAL], rows[6]["timing_s/testing"] = 0.6, 1.0
    return rows


def test_scores_are_first_last_and_best():
    scores = summarize(_history(), window=3).facts(SCORES)
    assert scores["reward first"] == "0.100"
    assert scores["reward last"] == "0.800"
    assert scores["reward best"] == "0.900 (step 5)"
    # 3-step means: 0.3, 0.4667, 0.6, 0.7667 (steps 4-6)
    assert scores["reward, 3-step mean first"] == "0.300"
    assert scores["reward, 3-step mean last"] == "0.767"
    assert scores["reward, 3-step mean best"] == "0.767 (steps 4-6)"
    # validation counts step 0 (the initial weights) as its first score
    assert scores["val gsm8k/reward/mean@2 first"] == "0.200"
    assert scores["val gsm8k/reward/mean@2 last"] == "0.600"
    assert scores["val gsm8k/reward/mean@2 best"] == "0.700 (step 3)"


def test_headline_time_per_phase_and_tokens_per_second():
    history = _history()
    history[1].update({"timing_s/startup/actor": 5.0, "timing_s/startup/total": 9.0})
    summary = summarize(history)
    # the step-0 validation row is no step: 6 steps of 2 s; throughput 100..600 -> mean 350
    assert summary.headline == "6 steps in 12.0s, 350 tokens/s"
    time = summary.facts(TIME)
    assert time["gen per step"] == "1.00s"
    assert time["update_weights per step"] == "0.25s"
    table = {row[0]: row[1:] for row in summary.tables[1].rows}
    assert table["gen"] == ("6.0s", "50%", "1.00s")
    assert table["update_actor"] == ("3.0s", "25%", "0.50s")
    # validation's seconds within steps: step 0's is no step's time
    assert table["testing"] == ("2.0s", "17%", "0.33s")
    # the start-up's seconds, logged with step 1, are spent before any step: no phase
    assert not any(name.startswith("startup/") for name in table)
    assert list(table)[:6] == [
        "gen",
        "old_log_prob",
        "ref",
        "adv",
        "update_actor",
        "update_weights",
    ]


def test_what_the_planner_and_gates_saved():
    saved = summarize(_history()).facts(SAVED)
    assert saved["pruned (zero advantage)"] == "50% of sequences, 25% of tokens (1,500 of 6,000)"
    assert saved["ghost steps"] == "1 of 12 skipped (nothing left to train)"
    # recompute fractions 0, .5, 0, .5, 0, .5: 75% skipped on average, all of it on 3 steps
    assert saved["old-logprob recompute"] == (
        "skipped for 75% of sequences, the whole pass on 3 of 6 steps"
    )
    assert saved["reference pass"] == "skipped on 6 of 6 steps"
    assert saved["weight sync"] == "base/full weights on 6 of 6 steps (1.50s)"


def test_missing_keys_leave_rows_out():
    rows = [{"step": 1, "critic/rewards/mean": 0.5, "timing_s/step": 1.0}]
    summary = summarize(rows)
    assert summary.headline == "1 step in 1.0s"
    assert [t.title for t in summary.tables] == [SCORES]
    assert summary.facts(SCORES) == {
        "reward first": "0.500",
        "reward last": "0.500",
        "reward best": "0.500 (step 1)",
    }
    assert summarize([]).text() == "no steps ran"
    # NaN is null in metrics.jsonl: left out, not a crash
    rows.append({"step": 2, "critic/rewards/mean": None, "timing_s/step": 1.0})
    assert summarize(rows).facts(SCORES)["reward last"] == "0.500"


def test_plain_text_is_an_aligned_table():
    text = run_summary(_history(with_validation=False))
    lines = text.splitlines()
    assert lines[0] == "6 steps in 12.0s, 350 tokens/s"
    header = lines[lines.index("scores") + 1]
    reward = lines[lines.index("scores") + 2]
    assert header.split() == ["metric", "first", "last", "best"]
    assert reward.split() == ["reward", "0.100", "0.800", "0.900", "(step", "5)"]
    assert header.index("first") == reward.index("0.100")  # columns line up


def test_compare_lines_two_runs_up_by_label():
    slower = [{**row, "timing_s/step": 4.0, "timing_s/gen": 3.0} for row in _history()[1:]]
    tables = compare({"a": summarize(_history(with_validation=False)), "b": summarize(slower)})
    by_title = {t.title: {row[0]: row[1:] for row in t.rows} for t in tables}
    assert by_title["run"]["time"] == ("12.0s", "24.0s")
    assert by_title[SCORES]["reward best"] == ("0.900 (step 5)", "0.900 (step 5)")
    assert by_title[SCORES]["val gsm8k/reward/mean@2 first"] == ("-", "0.700")
    assert by_title[TIME]["gen per step"] == ("1.00s", "3.00s")
    assert "gen total" not in by_title[TIME]  # per step only: runs of any length compare


def _png(path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return data


def test_plot_is_a_png_of_every_panel(tmp_path):
    pytest.importorskip("matplotlib")
    full = plot_runs({"run": _history()}, tmp_path / "full.png")
    bare = plot_runs({"run": _history(with_validation=False)}, tmp_path / "bare.png")
    assert len(_png(full)) > 20_000 and len(_png(bare)) > 20_000
    assert _size(full) == (1280, 1080)  # five panels: three rows of two
    assert _size(bare) == (1280, 720)  # four panels: no validation panel
    assert not list(tmp_path.glob("*.tmp"))


def test_plot_leaves_out_missing_keys(tmp_path):
    pytest.importorskip("matplotlib")
    rewards_only = [{"step": s, "critic/rewards/mean": r} for s, r in enumerate(REWARDS, 1)]
    out = plot_runs({"run": rewards_only}, tmp_path / "one.png")
    assert _size(out) == (640, 360)  # one panel
    empty = plot_runs({"run": []}, tmp_path / "empty.png")
    assert _size(empty) == (640, 360)  # a page that says there is nothing to plot


def test_compare_plot_overlays_both_runs(tmp_path):
    pytest.importorskip("matplotlib")
    other = [
        {**row, "critic/rewards/mean": 1 - row.get("critic/rewards/mean", 0)} for row in _history()
    ]
    one = plot_runs({"a": _history()}, tmp_path / "one.png")
    both = plot_runs({"a": _history(), "b": other}, tmp_path / "both.png")
    assert _size(both) == _size(one)
    assert len(_png(both)) > len(_png(one))  # a second set of curves and bars


def test_write_summary_plot_warns_instead_of_raising(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert write_summary_plot(_history(), tmp_path / "run" / "summary.png")
    _png(tmp_path / "run" / "summary.png")
    blocked = tmp_path / "file"
    blocked.write_text("a file where the run folder should be")
    assert not write_summary_plot(_history(), blocked / "summary.png")
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"megarl-train: warning: {blocked / 'summary.png'}: summary plot not")


def test_write_summary_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    assert not write_summary_plot(_history(), tmp_path / "summary.png")
    assert not (tmp_path / "summary.png").exists()
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("matplotlib is not installed (pip install matplotlib)")
    )


def _size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class _Stream:
    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_a_resumed_host_summarizes_and_plots_every_step(tmp_path, monkeypatch, capsys):
    """The rollout host, given back the history a resume reads from metrics.jsonl (the initial
    validation at step 0 and steps 1-3), plots and summarizes all of it, not only new steps."""
    from megarl.config.schema import build_run_config
    from megarl.trainer import rollout_host
    from megarl.trainer.metrics import MetricsWriter

    plotted = []
    monkeypatch.setattr(
        rollout_host, "write_summary_plot", lambda rows, out: plotted.append((rows, out))
    )
    host = object.__new__(rollout_host.RolloutHost)  # no engine, model or data: only the metrics
    host.cfg = build_run_config({"trainer": {"run_dir": str(tmp_path)}})
    host.stream, host.engine = _Stream(), None
    host.writer = MetricsWriter(tmp_path, tensorboard=False, jsonl=False)
    host.console = rollout_host.Console(total_steps=4)
    host.load_state_dict({"stream": {"epoch": 1}}, _history()[:4])
    host.write_summary_plot()
    [(rows, out)] = plotted
    assert [row["step"] for row in rows] == [0, 1, 2, 3] and out == tmp_path / "summary.png"
    assert [row["step"] for row in host.history] == [1, 2, 3]  # training steps only
    host.close()
    printed = capsys.readouterr().out
    assert "Run summary: 3 steps in 6.0s, 200 tokens/s" in printed
    assert "0.200 (step 0)" not in printed and "0.700 (step 3)" in printed  # best validation
    for title in (SCORES, TIME, SAVED):
        assert title in printed

"""The live progress display: descriptions, the run's ETA, when it is on, and the rich sink."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console as RichConsole

from megarl.trainer.progress import (
    LiveProgress,
    PhaseProgress,
    describe,
    format_eta,
    no_progress,
    progress_enabled,
    reported,
    run_eta_s,
)
from megarl.trainer.rollout_host import Console


@pytest.mark.parametrize(
    ("report", "text"),
    [
        (PhaseProgress("gen", 0, 16, "sequences"), "gen 0/16 sequences"),
        (
            PhaseProgress("update_actor", 2, 4, "optimizer steps"),
            "update_actor 2/4 optimizer steps",
        ),
        (PhaseProgress("update_weights", 3, 7, "buckets"), "update_weights 3/7 buckets"),
        (PhaseProgress("update_weights", 0), "update_weights"),
        (PhaseProgress("validate", 5, None, "prompts"), "validate 5 prompts"),
        (PhaseProgress("ref", 8, 8), "ref 8/8"),
    ],
)
def test_describe(report, text):
    assert describe(report) == text


def test_eta_is_the_mean_step_time_for_each_step_left_less_the_current_steps_time():
    # mean of 40, 30, 30 = 33.33; 4 steps left, the current one 10 s in: 3 * 33.33 + 23.33
    assert run_eta_s([40.0, 30.0, 30.0], steps_left=4, elapsed_s=10.0) == pytest.approx(
        123.333, 1e-4
    )


def test_eta_averages_only_the_recent_steps():
    # the first step (warm-up, 100 s) has left the window of 5: mean 30
    assert run_eta_s([100.0] + [30.0] * 5, steps_left=2, elapsed_s=0.0) == pytest.approx(60.0)
    assert run_eta_s([100.0, 20.0], steps_left=1, elapsed_s=0.0, window=1) == pytest.approx(20.0)


def test_a_step_running_late_still_leaves_the_steps_after_it():
    assert run_eta_s([30.0], steps_left=3, elapsed_s=45.0) == pytest.approx(60.0)


def test_eta_is_unknown_before_a_step_ends_and_zero_when_none_is_left():
    assert run_eta_s([], steps_left=5, elapsed_s=3.0) is None
    assert run_eta_s([30.0], steps_left=0, elapsed_s=0.0) == 0.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "ETA -:--:--"), (0.4, "ETA 0:00:00"), (59.6, "ETA 0:01:00"), (3725.0, "ETA 1:02:05")],
)
def test_format_eta(seconds, text):
    assert format_eta(seconds) == text


@pytest.mark.parametrize(
    ("setting", "console_on", "isatty", "on"),
    [
        ("auto", True, True, True),
        ("auto", True, False, False),  # CI logs, sbatch files: the step lines alone
        ("auto", False, True, False),
        (True, True, False, True),
        (True, False, True, False),
        (False, True, True, False),
    ],
)
def test_progress_enabled(setting, console_on, isatty, on):
    assert progress_enabled(setting, console_on, isatty) is on


def test_reported_brackets_the_block_with_zero_and_the_total():
    calls = []
    with reported(lambda *args: calls.append(args), "ref", 12, "sequences"):
        calls.append("work")
    assert calls == [("ref", 0, 12, "sequences"), "work", ("ref", 12, 12, "sequences")]
    with reported(no_progress, "ref", 12, "sequences"):
        pass


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _terminal() -> tuple[RichConsole, io.StringIO]:
    out = io.StringIO()
    return RichConsole(file=out, force_terminal=True, width=160, color_system=None), out


def test_the_sink_shows_the_phase_and_the_run_eta():
    console, out = _terminal()
    clock = _Clock()
    sink = LiveProgress(console, total_steps=3, clock=clock)
    sink.start()
    try:
        sink.phase("gen", 0, 8, "sequences")
        assert "gen 0/8 sequences" in out.getvalue()
        assert sink.eta() == "ETA -:--:--"  # no step has ended yet
        clock.now += 30.0
        sink.step_done(30.0)
        sink.phase("update_actor", 2, 4, "optimizer steps")  # step 2 starts now
        clock.now += 10.0
        # 2 steps left at 30 s, the current one 10 s in: 20 + 30 = 50 s
        assert sink.eta() == "ETA 0:00:50"
        sink.phase("update_weights", 3, 7, "buckets")
    finally:
        sink.stop()
    shown = out.getvalue()
    assert "update_actor 2/4 optimizer steps" in shown
    assert "update_weights 3/7 buckets" in shown
    assert "1/3 steps" in shown
    assert "ETA 0:00:50" in shown


def test_a_resumed_runs_steps_count_as_done_without_times():
    console, _ = _terminal()
    clock = _Clock()
    sink = LiveProgress(console, total_steps=10, clock=clock)
    sink.skip(6)
    sink.phase("gen", 0, 8, "sequences")
    assert sink.eta() == "ETA -:--:--"
    clock.now += 20.0
    sink.step_done(20.0)
    assert sink.eta() == "ETA 0:01:00"  # 3 steps left at 20 s


def _record(step: int) -> dict:
    return {
        "step": step,
        "critic/rewards/mean": 0.5,
        "critic/advantages/zero_adv_ratio": 0.25,
        "actor/pg_loss": -0.0123,
        "actor/entropy": 1.234,
        "response_length/mean": 5.5,
        "rollout/logprob_abs_diff": 2e-6,
        "timing_s/step": 31.0,
    }


STEP_LINE = (
    "step   1 | reward 0.500 | zero-adv 25% | pg_loss -0.0123 | entropy 1.234 | len 5.5 | "
    "lp_diff 2.0e-06 | 31.0s"
)


def test_off_the_console_prints_only_the_step_lines(monkeypatch):
    out = io.StringIO()  # not a terminal: auto is off, as in CI logs and sbatch files
    monkeypatch.setattr(sys, "stdout", out)
    console = Console(total_steps=2, enabled=True, progress="auto")
    assert not console.shows_progress
    console.phase("gen", 0, 8, "sequences")
    console.step(_record(1), [("1+1", " 2 ", 1.0)])
    assert out.getvalue().splitlines() == [STEP_LINE, "         sample: '1+1' -> '2' (reward 1)"]


def test_progress_true_draws_the_phase_even_into_a_file(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    console = Console(total_steps=2, enabled=True, progress=True)
    assert console.shows_progress
    console.phase("old_log_prob", 0, 8, "sequences")
    console.step(_record(1), [])
    console.finish([])
    shown = out.getvalue()
    assert "old_log_prob 0/8 sequences" in shown
    assert STEP_LINE in shown

"""The start-up clock: per-phase seconds, a total that covers what no phase names, one line."""

from __future__ import annotations

import time

from megarl.trainer.metrics import StartupClock, startup_line


def test_phases_add_up_and_the_total_covers_the_gaps_between_them():
    clock = StartupClock()
    with clock.phase("actor"):
        time.sleep(0.02)
    time.sleep(0.03)  # e.g. the tokenizer and the data's checks: no phase of its own
    with clock.phase("restore"):
        time.sleep(0.01)
    with clock.phase("restore"):  # a phase entered twice adds up
        time.sleep(0.01)
    metrics = clock.metrics()
    assert list(metrics) == [
        "timing_s/startup/actor",
        "timing_s/startup/restore",
        "timing_s/startup/total",
    ]
    assert metrics["timing_s/startup/actor"] >= 0.02
    assert metrics["timing_s/startup/restore"] >= 0.02
    named = metrics["timing_s/startup/actor"] + metrics["timing_s/startup/restore"]
    assert metrics["timing_s/startup/total"] >= named + 0.03


def test_a_phase_that_raises_is_still_timed():
    clock = StartupClock()
    try:
        with clock.phase("rollout_host"):
            raise RuntimeError("engine failed")
    except RuntimeError:
        pass
    assert "timing_s/startup/rollout_host" in clock.metrics()


def test_the_line_lists_phases_in_order_after_the_total():
    metrics = {
        "timing_s/startup/rollout_host": 12.06,
        "timing_s/startup/actor": 6.0,
        "timing_s/startup/total": 23.44,
    }
    assert startup_line(metrics) == "start-up 23.4s: rollout_host 12.1s | actor 6.0s"

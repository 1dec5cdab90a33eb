"""Heartbeats report the main loop's progress, and the watch picks the rank that stopped first."""

from __future__ import annotations

import json
import os
import time

import pytest

from megarl.distributed import heartbeat
from megarl.distributed.heartbeat import Beat, HeartbeatWatch, beat_path


def _beat(folder, rank: int, pid: int, age_s: float, phase: str = "update_actor") -> None:
    beat = Beat(rank, "node0", pid, 2, phase, time.time() - age_s)
    beat_path(folder, rank).write_text(json.dumps(beat.__dict__))


def test_thread_keeps_writing_but_progress_is_the_main_loops(tmp_path):
    heartbeat.start(str(tmp_path), rank=3, interval_s=0.05)
    heartbeat.mark("rollout", step=7)
    marked_at = time.time()
    time.sleep(0.3)  # the "main loop" makes no progress; the thread rewrites the file
    heartbeat.stop()
    watch = HeartbeatWatch(str(tmp_path), timeout_s=60)
    [beat] = watch.read({3: os.getpid()}).values()
    assert (beat.rank, beat.step, beat.phase, beat.pid) == (3, 7, "rollout", os.getpid())
    assert abs(beat.progress_at - marked_at) < 0.05
    assert beat_path(tmp_path, 3).stat().st_mtime - marked_at > 0.15  # rewritten since
    assert watch.stalest({3: os.getpid()}, older_than_s=0.2) == beat
    assert watch.stalest({3: os.getpid()}, older_than_s=5) is None
    assert "no progress for 0 s during rollout of step 7" in beat.describe(beat.progress_at)


def test_stalest_rank_is_the_one_that_stopped_first(tmp_path):
    _beat(tmp_path, 0, pid=100, age_s=20)
    _beat(tmp_path, 1, pid=101, age_s=30, phase="rollout")
    _beat(tmp_path, 2, pid=102, age_s=1)
    watch = HeartbeatWatch(str(tmp_path), timeout_s=15)
    beat = watch.stalest({0: 100, 1: 101, 2: 102}, older_than_s=15)
    assert beat is not None and (beat.rank, beat.phase) == (1, "rollout")
    # a beat left by another process (an earlier run) is not this rank's
    assert watch.stalest({1: 999}, older_than_s=15) is None


def test_a_rank_waiting_for_a_failed_peer_is_not_blamed(tmp_path):
    """Rank 0 raised after a long phase; rank 1, waiting for it, advanced later: not the cause."""
    _beat(tmp_path, 0, pid=100, age_s=40)
    _beat(tmp_path, 1, pid=101, age_s=39)
    watch = HeartbeatWatch(str(tmp_path), timeout_s=60)
    assert watch.stalest({1: 101}, older_than_s=30, failed={0: 100}) is None
    _beat(tmp_path, 1, pid=101, age_s=41)  # rank 1 stopped first: its peer's error followed
    beat = watch.stalest({1: 101}, older_than_s=30, failed={0: 100})
    assert beat is not None and beat.rank == 1


def test_start_up_is_left_to_the_collective_timeout(tmp_path):
    beat = Beat(0, "node0", 100, 0, "build_actor", time.time() - 100)
    beat_path(tmp_path, 0).write_text(json.dumps(beat.__dict__))
    watch = HeartbeatWatch(str(tmp_path), timeout_s=15)
    assert watch.stalest({0: 100}, older_than_s=25, in_steps_only=True) is None
    assert watch.stalest({0: 100}, older_than_s=25) == beat


def test_failure_lines_are_built_once_for_both_launchers():
    """The local launcher's line names the node from the heartbeat and the pid in the detail; a
    Ray placement (which already names the pid) replaces the first part only."""
    from megarl.distributed.launcher import raised_error_report, stuck_rank_report

    beat = Beat(1, "node7", 4242, 3, "save", 1000.0)
    local = stuck_rank_report(beat, now=1012.0, peers_failed=1)
    assert str(local) == (
        "actor rank 1 on node node7 failed: stopped responding: no progress for 12 s during "
        "save of step 3 (pid 4242); then 1 other rank(s) failed"
    )
    where = "actor rank 1 on node node7 (10.0.0.7, ray node abcd1234, pid 4242)"
    ray_line = stuck_rank_report(beat, now=1012.0, peers_failed=0, where=where)
    assert str(ray_line) == (
        f"{where} failed: stopped responding: no progress for 12 s during save of step 3"
    )
    raised = raised_error_report(1, "KeyError: 'x'\nmore", "Traceback ...", beat, where=where)
    assert str(raised) == f"{where} failed: KeyError: 'x' during save of step 3"
    assert (raised.rank, raised.traceback) == (1, "Traceback ...")
    assert str(raised_error_report(0, "OSError: disk", "", None)).endswith("failed: OSError: disk")


def test_an_error_publishes_the_phase_it_came_from_at_once(tmp_path):
    """The thread writes every 2 s; an error right after a phase began is reported with that
    phase, not the one before (the launcher reads the file as the error arrives)."""

    def rollout_that_raises() -> None:
        with heartbeat.published_on_error():
            heartbeat.mark("rollout", step=1)
            raise KeyError("x")

    heartbeat.start(str(tmp_path), rank=0, interval_s=60)
    try:
        heartbeat.mark("build_actor")
        with pytest.raises(KeyError):
            rollout_that_raises()
    finally:
        heartbeat.stop()
    [beat] = HeartbeatWatch(str(tmp_path), timeout_s=60).read({0: os.getpid()}).values()
    assert beat.during == "rollout of step 1"


def test_a_peer_whose_collective_timed_out_waited_for_the_stuck_rank_whenever_it_entered(
    tmp_path,
):
    """Rank 1 reached the next step's first collective before rank 0 began the step (rank 0
    writes metrics and checkpoints after the last collective), then timed out waiting for rank
    0, stuck in its rollout: rank 0 is named although it advanced after rank 1 did."""
    from megarl.distributed.launcher import WorkerFailed, is_collective_timeout, raise_if_stuck

    _beat(tmp_path, 0, pid=100, age_s=9, phase="rollout")
    _beat(tmp_path, 1, pid=101, age_s=10, phase="broadcast_rollout")
    watch = HeartbeatWatch(str(tmp_path), timeout_s=8)
    raise_if_stuck(watch, {0: 100}, {1: 101}, older_than_s=4)  # ordering alone: not named
    with pytest.raises(
        WorkerFailed, match=r"rank 0 .*during rollout of step 2 \(pid 100\); then 1 other"
    ):
        raise_if_stuck(watch, {0: 100}, {1: 101}, older_than_s=4, timed_out=frozenset({1}))
    gloo = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 8000ms for send operation to complete\nTraceback ..."
    assert is_collective_timeout(gloo)
    assert is_collective_timeout("DistBackendError: Watchdog caught collective operation timeout")
    assert not is_collective_timeout("KeyError: 'x'\n... timeout in the traceback")


def test_a_user_call_is_published_the_moment_it_starts_and_ends(tmp_path):
    """A process that dies inside user code raises nothing: the beat written as the call
    started is what names it, so it cannot wait for the thread's next write."""
    from megarl.user_code import user_call

    heartbeat.start(str(tmp_path), rank=0, interval_s=60)
    try:
        heartbeat.mark("rollout", step=3)
        watch = HeartbeatWatch(str(tmp_path), timeout_s=60)
        with user_call("tool a: execute (sample 1)"), user_call("tool b: execute (sample 2)"):
            [beat] = watch.read({0: os.getpid()}).values()
        [after] = watch.read({0: os.getpid()}).values()
    finally:
        heartbeat.stop()
    assert beat.user_call == "tool b: execute (sample 2) (and 1 more)"
    assert beat.during == "rollout of step 3, while running tool b: execute (sample 2) (and 1 more)"
    assert after.user_call == "" and after.during == "rollout of step 3"

"""The launcher's watch over a one-process run (a world of one runs in the launcher's own
process): a main loop that stops is interrupted and named like a spawned rank; one that cannot
be interrupted (stuck in native code) is ended with the same line. End to end, with a reward
function that never returns: ``tests/integration/test_run_lifecycle.py``."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megarl.distributed import heartbeat, launcher
from megarl.distributed.heartbeat import HeartbeatWatch
from megarl.distributed.launcher import WorkerContext, WorkerFailed, launch


def freezes_in_rollout(ctx: WorkerContext) -> None:
    heartbeat.start(ctx.heartbeat_dir, ctx.rank, interval_s=0.2)
    heartbeat.mark("rollout", 2)
    while True:
        time.sleep(3600)


def test_a_frozen_main_loop_is_interrupted_and_named_with_its_phase(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "STALE_GRACE_S", 0.0)
    watch = HeartbeatWatch(str(tmp_path / ".heartbeat"), timeout_s=1.0)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where started in the background
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        launch(freezes_in_rollout, 1, watch=watch)
    message = str(failed.value)
    assert "actor+rollout rank 0 on node" in message
    assert "stopped responding: no progress for" in message
    assert "during rollout of step 2" in message
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler restored
    assert not (tmp_path / ".heartbeat").exists()


def test_without_a_watch_a_world_of_one_just_runs_here():
    assert launch(lambda ctx: (ctx.rank, ctx.world_size, ctx.heartbeat_dir), 1) == [(0, 1, None)]


def fails_holding_a_process_group_and_the_cpu_shims(ctx: WorkerContext) -> None:
    import torch.distributed as dist

    from megarl.distributed.platform import enter_cpu_shims

    enter_cpu_shims()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}", rank=0, world_size=1
    )
    raise ValueError("the run failed half-way through its set-up")


def test_a_failed_world_of_one_leaves_this_process_as_it_found_it():
    """The next run in the same process (a benchmark's next model, the next test) would find
    the process group taken and its CUDA tensors moved to the CPU by the shims."""
    import torch.distributed as dist

    from megarl.distributed.platform import shims_active

    for _ in range(2):  # the second would fail with "initialize the default process group twice"
        with pytest.raises(ValueError, match="half-way"):
            launch(fails_holding_a_process_group_and_the_cpu_shims, 1)
        assert not dist.is_initialized()
        assert not shims_active()


UNINTERRUPTIBLE = textwrap.dedent(
    """
    import signal, sys, time
    from megarl.distributed import heartbeat, launcher
    from megarl.distributed.heartbeat import HeartbeatWatch

    def stuck(ctx):
        heartbeat.start(ctx.heartbeat_dir, 0, interval_s=0.2)
        heartbeat.mark("update_actor", 3)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as native code never returns
        while True:
            time.sleep(3600)

    launcher.STALE_GRACE_S = 0.0
    launcher.InProcessWatch.HARD_EXIT_AFTER_S = 1.0
    launcher.launch(stuck, 1, watch=HeartbeatWatch(sys.argv[1], timeout_s=1.0))
    """
)


def test_a_main_thread_that_cannot_be_interrupted_is_ended_with_the_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", UNINTERRUPTIBLE, str(tmp_path / ".heartbeat")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("megarl-train: error:")]
    assert "during update_actor of step 3" in line
    assert line.endswith("(its main thread did not respond; the process was ended)")


def exits_quietly(ctx: WorkerContext) -> None:
    raise SystemExit(False)  # what unittest.main() raises when every test passed


def test_a_rank_that_raises_system_exit_zero_fails_the_run_instead_of_ending_it_well():
    """No rank's work ends in ``SystemExit``; of code 0 it would be the run's exit 0."""
    with pytest.raises(WorkerFailed) as failed:
        launch(exits_quietly, 1)
    message = str(failed.value)
    assert "the rank raised SystemExit(False) (at tests/unit/test_in_process_watch.py:" in message
    assert "before its work was done" in message
    assert failed.value.exit_code == 1
    assert launcher.is_reported_exit(SystemExit(2)) and not launcher.is_reported_exit(
        SystemExit("bye")
    )

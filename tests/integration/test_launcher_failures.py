"""A rank that dies mid-run (as a SIGKILL or the OOM killer would leave it) stops the run with
one line naming role, rank and node, a non-zero exit, within a bound -- under both launchers; so
does the split placement's rollout actor (named as the rollout actor, not as rank 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import run_env, tiny_overrides

pytestmark = pytest.mark.slow

DETECT_BOUND_S = 60  # death -> process exit; the collective timeout below is the backstop


def _run_killed(
    train_cli, tmp_path, fault: str, steps: int, **overrides
) -> tuple[list[str], float]:
    """Run ``megarl-train`` (forked from a warm interpreter, see forked_cli.py) with
    ``MEGARL_FAULT_INJECT=fault``; assert it exits 1 with exactly one error line. Returns that
    line (in a list) and seconds from the death to the exit."""
    mark = tmp_path / "killed_at"
    env = run_env(MEGARL_FAULT_INJECT=fault, MEGARL_FAULT_INJECT_MARK=str(mark))
    overrides = {"trainer.collective_timeout_s": 120, **overrides}
    args = tiny_overrides(tmp_path / "run", steps=steps, **overrides)
    done = train_cli.run(*args, cwd=tmp_path, env=env, timeout_s=600)
    exited = time.time()
    errors = [line for line in done.stderr.splitlines() if line.startswith("megarl-train: error")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors, exited - float(mark.read_text())


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_killed_rank_is_named_and_run_exits_nonzero(tmp_path, train_cli, launcher):
    errors, detect_s = _run_killed(
        train_cli,
        tmp_path,
        "1:2",
        steps=3,
        **{"trainer.launcher": launcher, "trainer.n_gpus_per_node": 2, "actor.tp": 2},
    )
    assert "actor rank 1 on node" in errors[0] and "failed" in errors[0], errors[0]
    print(f"{launcher}: rank 1 killed -> exit in {detect_s:.1f} s: {errors[0]}")
    assert detect_s < DETECT_BOUND_S
    # whatever was recorded is whole lines (rank 0 may be stopped before it records step 1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    assert [r["step"] for r in rows] in ([], [1])


@pytest.mark.parametrize(
    ("mode", "calls"),
    [("sync", ("rollout",)), ("fully_async", ("next_batch", "engine update_weights"))],
)
def test_killed_rollout_actor_is_named_not_rank_0(tmp_path, train_cli, mode, calls):
    """Split placement: the rollout actor dies as it starts step 2's rollout (asynchronous: as
    its loop starts generating step 2, while step 1 trains). Rank 0 notices (its Ray call fails)
    but the one error line names the rollout actor and its node, within the bound; the other
    rank, blocked in the broadcast, does not make the run hang. Asynchronous, rank 0's next
    call is step 2's batch or, when step 1's training ends first, its weight push: either
    notices the death."""
    errors, detect_s = _run_killed(
        train_cli,
        tmp_path,
        "rollout:2",
        steps=2,
        **{
            "trainer.launcher": "ray",
            "rollout.n_gpus": 1,
            "trainer.n_gpus_per_node": 2,
            "actor.tp": 2,
            "async_training.mode": mode,
        },
    )
    assert "rollout actor on node" in errors[0] and "the process died" in errors[0], errors[0]
    assert any(f"during {call}" in errors[0] for call in calls), errors[0]
    assert "rank 0" not in errors[0], errors[0]
    print(f"rollout actor killed at step 2 -> exit in {detect_s:.1f} s: {errors[0]}")
    assert detect_s < DETECT_BOUND_S


def test_an_error_raised_in_a_ray_rank_is_one_line_with_its_phase_and_a_logged_traceback(
    tmp_path, train_cli
):
    """Rank 1's loop raises as step 1's rollout begins: exit 1, one line naming its placement,
    the error and the phase; the remote traceback (down to the raising frame) is in
    logs/error-rank1.txt, not on the console."""
    env = run_env(MEGARL_FAULT_RAISE="1:1")
    run_dir = tmp_path / "run"
    layout = {"trainer.launcher": "ray", "trainer.n_gpus_per_node": 2, "actor.tp": 2}
    done = train_cli.run(*tiny_overrides(run_dir, steps=1, **layout), cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = [row for row in done.stderr.splitlines() if row.startswith("megarl-train: error")]
    log = run_dir / "logs" / "error-rank1.txt"
    assert line.startswith("megarl-train: error: actor rank 1 on node "), line
    assert line.endswith(
        "failed: InjectedError: fault injection: rank 1 raises at step 1 during rollout of "
        f"step 1 (traceback: {log})"
    ), line
    assert "in maybe_raise" in log.read_text()
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_killed_rank_then_resume_auto_completes_the_run(tmp_path):
    """The failure-injection test: rank 1 dies at the start of step 3 (after the step-2
    checkpoint was published), the run stops within the bound naming rank 1; the same command
    again, without the fault, resumes from step 2 and finishes with every step recorded once.
    Neither run prints a third-party warning (see :mod:`megarl.distributed.quiet`)."""
    total, die_at, run_dir = 3, 3, tmp_path / "run"
    mark = tmp_path / "killed_at"
    base_env = run_env()
    command = [
        sys.executable,
        "-m",
        "megarl.train",
        *tiny_overrides(
            run_dir,
            steps=total,
            **{
                "trainer.launcher": "local",
                "trainer.n_gpus_per_node": 2,
                "actor.tp": 2,
                "trainer.save_interval": 1,
                "trainer.resume": "auto",
                "trainer.collective_timeout_s": 120,
            },
        ),
    ]

    killed = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **base_env,
            "MEGARL_FAULT_INJECT": f"1:{die_at}",
            "MEGARL_FAULT_INJECT_MARK": str(mark),
        },
    )
    detect_s = time.time() - float(mark.read_text())
    errors = [line for line in killed.stderr.splitlines() if line.startswith("megarl-train: error")]
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert len(errors) == 1 and "rank 1" in errors[0], killed.stderr[-3000:]
    assert detect_s < DETECT_BOUND_S, f"rank 1 died {detect_s:.1f} s before the run exited"
    assert [r["step"] for r in _metric_rows(run_dir)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_000001",
        "step_000002",
    ]

    resumed = subprocess.run(
        command, cwd=tmp_path, env=base_env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # no third-party warning on the console, from the launcher, the fork server or a rank
    assert _warning_lines(killed.stderr) == _warning_lines(resumed.stderr) == [], resumed.stderr
    said = [line for line in resumed.stdout.splitlines() if "megarl-train: resuming from" in line]
    assert len(said) == 1 and "step_000002 (step 2)" in said[0], resumed.stdout[-3000:]
    assert [r["step"] for r in _metric_rows(run_dir)] == list(range(1, total + 1))
    print(f"rank 1 killed at step {die_at} -> exit in {detect_s:.1f} s: {errors[0]}; {said[0]}")


def _warning_lines(stderr: str) -> list[str]:
    """The lines of a Python warning (``file:line: UserWarning: text`` and its source line)."""
    return [
        line for line in stderr.splitlines() if "UserWarning" in line or "warnings.warn(" in line
    ]


def _metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _peer_fails_first(ctx, sync_dir: str) -> None:
    """Rank 1 is "killed" just after rank 0 reports the peer error it would see in a collective:
    the order in which the parent hears about them when the killed rank is reaped late."""
    ready, waiting = Path(sync_dir) / "rank1_ready", Path(sync_dir) / "rank0_waiting"
    if ctx.rank == 1:
        while not waiting.exists():  # both ranks started (spawn times differ under load)
            time.sleep(0.01)
        ready.write_text("1")
        time.sleep(0.3)
        os._exit(137)
    waiting.write_text("0")
    while not ready.exists():
        time.sleep(0.01)
    raise RuntimeError("Connection closed by peer")


def test_killed_rank_is_named_not_the_peer_that_noticed(tmp_path):
    from megarl.distributed.launcher import WorkerFailed, launch

    with pytest.raises(WorkerFailed) as failed:
        launch(_peer_fails_first, 2, args=(str(tmp_path),), timeout_s=120)
    assert failed.value.rank == 1 and failed.value.exitcode == 137, str(failed.value)
    assert "then 1 other rank(s) failed" in str(failed.value)


def _tool_ends_rank_1(ctx, sync_dir: str) -> None:
    """Rank 1's tool ends its process with status 0 from C (an extension's ``_exit(0)``, which
    no guard of ``os._exit`` sees; nothing raised); rank 0 then fails in its next collective,
    as a real peer would."""
    import ctypes

    from megarl.distributed import heartbeat
    from megarl.user_code import user_call

    heartbeat.start(ctx.heartbeat_dir, ctx.rank, interval_s=60)  # only the call publishes
    heartbeat.mark("rollout", 2)
    if ctx.rank == 1:
        with user_call("tool crash: execute (sample 3)"):
            ctypes.CDLL(None)._exit(0)
    time.sleep(2)
    raise RuntimeError("Connection closed by peer")


def test_a_rank_ended_by_user_code_with_status_0_is_named_with_the_call(tmp_path):
    from megarl.distributed.heartbeat import HeartbeatWatch
    from megarl.distributed.launcher import WorkerFailed, launch

    watch = HeartbeatWatch(str(tmp_path / ".heartbeat"), timeout_s=120)
    with pytest.raises(WorkerFailed) as failed:
        launch(_tool_ends_rank_1, 2, args=(str(tmp_path),), timeout_s=120, watch=watch)
    message = str(failed.value)
    assert failed.value.rank == 1 and failed.value.exitcode == 0, message
    assert "exited with status 0 before its work was done, without a Python error" in message
    assert "during rollout of step 2, while running tool crash: execute (sample 3)" in message


def _bad_input_on_rank_0(ctx, sync_dir: str) -> None:
    """Rank 0 finds bad input (a reward function failing); rank 1 then fails in the next
    collective, as a real peer would."""
    from megarl.errors import BadInputError

    failed, ready = Path(sync_dir) / "rank0_failed", Path(sync_dir) / "rank1_ready"
    if ctx.rank == 0:
        while not ready.exists():  # both ranks started: the peer fails within the grace
            time.sleep(0.01)
        failed.write_text("0")
        raise BadInputError("data.reward=m:f: sample 0 (step 1) returned nan")
    ready.write_text("1")
    while not failed.exists():
        time.sleep(0.01)
    raise RuntimeError("Connection closed by peer")


def test_bad_input_in_a_rank_is_its_one_line_with_exit_2_and_no_peer_traceback(tmp_path, capfd):
    from megarl.distributed.launcher import WorkerFailed, launch

    with pytest.raises(WorkerFailed) as failed:
        launch(_bad_input_on_rank_0, 2, args=(str(tmp_path),), timeout_s=120)
    assert failed.value.rank == 0 and failed.value.exit_code == 2
    assert str(failed.value).endswith("failed: data.reward=m:f: sample 0 (step 1) returned nan")
    assert "Traceback" not in capfd.readouterr().err  # the peer's error went to the parent only


def _raise_on_rank_1(ctx):
    if ctx.rank == 1:
        raise KeyError("no such column")
    time.sleep(30)


def test_a_python_error_in_a_rank_is_one_line_and_keeps_its_traceback(capfd):
    from megarl.distributed.launcher import WorkerFailed, launch

    with pytest.raises(WorkerFailed) as failed:
        launch(_raise_on_rank_1, 2, timeout_s=120)
    assert failed.value.rank == 1
    assert str(failed.value).endswith("failed (exit code 1): KeyError: 'no such column'")
    assert "Traceback" in failed.value.traceback and "_raise_on_rank_1" in failed.value.traceback
    assert "Traceback" not in capfd.readouterr().err


def _report_surroundings(ctx) -> tuple[str | None, str, bool, bool]:
    """What a rank sees of its launcher: an environment variable, the working directory,
    whether the heavy libraries were already imported when it started, and whether its process
    is the run's own with its imports out of the garbage collector's walk."""
    import gc

    from megarl.distributed import heap

    print(f"rank {ctx.rank} says hello", flush=True)
    warm = "megatron.core.optimizer" in sys.modules
    frozen = heap.owned() and gc.get_freeze_count() > 0
    return os.environ.get("MEGARL_TEST_PROBE"), os.getcwd(), warm, frozen


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_see_the_launchers_environment_and_streams_as_they_are_now(
    tmp_path, monkeypatch, capfd, method
):
    """A worker forked from the long-lived fork server still sees the launcher's environment,
    working directory and stdout as they are when the run starts, like a spawned one; only
    the forked one starts with Megatron-Core already imported. Both are the run's own
    processes; a world of one runs in the caller's, which stays the caller's."""
    from megarl.distributed import heap
    from megarl.distributed.launcher import launch

    monkeypatch.setenv("MEGARL_WORKER_START", method)
    for value, cwd in (("first", tmp_path), ("second", tmp_path.parent)):
        monkeypatch.setenv("MEGARL_TEST_PROBE", value)
        monkeypatch.chdir(cwd)
        results = launch(_report_surroundings, 2, timeout_s=120)
        assert results == [(value, str(cwd), method == "forkserver", True)] * 2
        out = capfd.readouterr().out
        assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    [(_, _, _, frozen_here)] = launch(_report_surroundings, 1, timeout_s=120)
    assert not frozen_here and not heap.owned()

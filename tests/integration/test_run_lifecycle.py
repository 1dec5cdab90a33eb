"""A run's lifecycle: one run per run_dir, workers that die with the launcher, a stop signal
that stops every rank, and a frozen rank that is named instead of hanging the run -- under the
local launcher, and (the signal and the frozen rank) under the Ray launcher."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from helpers.runs import run_env, tiny_overrides

ENV = run_env()

pytestmark = pytest.mark.serial  # a hang or a stop must be seen within seconds

TWO_RANKS = {"trainer.n_gpus_per_node": 2, "actor.tp": 2}
WORKERS_GONE_S = 5.0


def _start(tmp_path, steps: int, env: dict[str, str] | None = None, **overrides):
    args = tiny_overrides(tmp_path / "run", steps=steps, **{**TWO_RANKS, **overrides})
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.train", *args],
        cwd=tmp_path,
        env={**ENV, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _workers(launcher_pid: int) -> list[psutil.Process]:
    """The launcher's rank processes: spawned by it, or forked by its fork server (not the
    server itself, nor multiprocessing's resource tracker)."""
    ranks = []
    for child in psutil.Process(launcher_pid).children():
        cmdline = " ".join(child.cmdline())
        if "spawn_main" in cmdline:
            ranks.append(child)
        elif "multiprocessing.forkserver" in cmdline:
            ranks.extend(child.children())
    return ranks


def _training_workers(launcher, run_dir: Path, timeout_s: float = 240) -> list[psutil.Process]:
    """Wait until step 1 is recorded (every rank is inside the step loop); the workers."""
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "metrics.jsonl").exists():
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "step 1 was not recorded in time"
        time.sleep(0.5)
    workers = _workers(launcher.pid)
    assert len(workers) == 2, workers
    return workers


def _assert_gone(workers: list[psutil.Process], within_s: float) -> float:
    """Seconds until every worker is gone (a zombie waiting to be reaped counts as gone)."""
    start = time.monotonic()
    while True:
        alive = [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"workers still alive: {alive}"
        time.sleep(0.1)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("megarl-train: error")]


def _failed_after(launcher, mark: Path) -> tuple[str, float]:
    """Wait for the run to end; it must exit 1. Its stderr, and the seconds from the fault (the
    time the injection wrote to ``mark``) to the exit."""
    _, stderr = launcher.communicate(timeout=300)
    detect_s = time.time() - float(mark.read_text())
    assert launcher.returncode == 1, stderr[-3000:]
    return stderr, detect_s


def _freeze_rank_1(
    tmp_path: Path,
    at_step: int,
    timeout_s: int,
    started: Callable[[subprocess.Popen, Path], list[psutil.Process]],
    **overrides,
) -> tuple[list[psutil.Process], str, float]:
    """A run of ``at_step + 1`` steps whose rank 1 freezes at step ``at_step`` (its main loop
    stops, its process lives on), collectives timing out after ``timeout_s``. Returns what
    ``started(launcher, mark)`` found running, the run's one error line, and the seconds from
    the freeze to the launcher's exit."""
    mark = tmp_path / "frozen_at"
    launcher = _start(
        tmp_path,
        steps=at_step + 1,
        env={"MEGARL_FAULT_FREEZE": f"1:{at_step}", "MEGARL_FAULT_INJECT_MARK": str(mark)},
        **overrides,
        **{"trainer.collective_timeout_s": timeout_s},
    )
    try:
        processes = started(launcher, mark)
        stderr, detect_s = _failed_after(launcher, mark)
    finally:
        launcher.kill()
    [line] = _errors(stderr)
    return processes, line, detect_s


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


def test_workers_die_when_the_launcher_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: each worker ends itself (the kernel's
    parent-death signal), and the lock it leaves is stale for the next run."""
    launcher = _start(tmp_path, steps=60)
    try:
        workers = _training_workers(launcher, tmp_path / "run")
        launcher.kill()
        launcher.wait()
        gone_s = _assert_gone(workers, WORKERS_GONE_S)
    finally:
        launcher.kill()
    print(f"launcher SIGKILLed: both workers gone in {gone_s:.2f} s")


def test_sigterm_stops_the_whole_run_with_one_line(tmp_path):
    """SIGINT takes the same path with exit 130 (tests/unit/test_stop_on_signals.py)."""
    sig, code = signal.SIGTERM, 143
    launcher = _start(tmp_path, steps=60)
    try:
        workers = _training_workers(launcher, tmp_path / "run")
        sent = time.monotonic()
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=30)
        exited_s = time.monotonic() - sent
    finally:
        launcher.kill()
    assert launcher.returncode == code, stderr[-3000:]
    stopped = [line for line in stderr.splitlines() if line.startswith("megarl-train:")]
    assert stopped == [f"megarl-train: stopped by {sig.name}: every rank was stopped"], stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    _assert_gone(workers, 1.0)  # joined before the launcher exited
    assert not (tmp_path / "run" / ".megarl.lock").exists()
    print(f"{sig.name}: run stopped in {exited_s:.1f} s, exit {code}")
    assert exited_s < 15


def test_frozen_rank_is_named_with_its_phase(tmp_path):
    """Rank 1's main loop freezes at step 2 (its process and heartbeat thread live on). Rank 0
    times out waiting for it; the one error line names rank 1, its node and what it was doing,
    within the timeout plus a margin, and no worker is left."""
    timeout_s = 15
    workers, line, detect_s = _freeze_rank_1(
        tmp_path, 2, timeout_s, lambda launcher, _: _training_workers(launcher, tmp_path / "run")
    )
    assert f"actor rank 1 on node {socket.gethostname()} failed: stopped responding" in line, line
    assert "during rollout of step 2" in line, line
    _assert_gone(workers, 1.0)
    print(f"rank 1 frozen at step 2 -> exit in {detect_s:.1f} s: {line}")
    assert detect_s < timeout_s + 15


def test_a_one_process_run_whose_reward_never_returns_is_named(tmp_path):
    """The default layout: one rank, in the launcher's own process, with nothing outside it to
    notice a hang. A reward function that never returns at step 2 (no data.reward_timeout_s)
    is named by the launcher's in-process watch with its phase, within the timeout plus a
    margin; the run unwinds (the run directory's lock is released) and exits 1."""
    timeout_s, mark = 5, tmp_path / "hung_at"
    launcher = _start(
        tmp_path,
        steps=3,
        env={"MEGARL_FAULT_INJECT_MARK": str(mark)},
        **{
            "trainer.n_gpus_per_node": 1,
            "actor.tp": 1,
            "data.reward": "synthetic_rewards:hangs_at_step_2",
            "trainer.collective_timeout_s": timeout_s,
        },
    )
    try:
        stderr, detect_s = _failed_after(launcher, mark)
    finally:
        launcher.kill()
    [line] = _errors(stderr)
    host = socket.gethostname()
    assert f"actor+rollout rank 0 on node {host} failed: stopped responding" in line, line
    assert "during rollout of step 2" in line, line
    assert not (tmp_path / "run" / ".megarl.lock").exists()  # unwound, not ended from outside
    print(f"reward hung at step 2 -> exit in {detect_s:.1f} s: {line}")
    assert detect_s < timeout_s + 15


# --- the Ray launcher: the same guarantees ------------------------------------------------------

RAY = {"trainer.launcher": "ray"}


def _ray_started(launcher, ready, timeout_s: float = 240) -> list[psutil.Process]:
    """Wait until ``ready()``; every process the driver's private Ray started (GCS, raylet,
    agents, the rank actors), after checking that both rank actors are among them."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the ranks did not start in time"
        time.sleep(0.5)
    processes = psutil.Process(launcher.pid).children(recursive=True)
    ranks = [p for p in processes if "RankActor" in p.name()]
    assert len(ranks) == 2, [p.name() for p in processes]
    return processes


@pytest.mark.slow
def test_ray_sigterm_stops_every_actor_with_one_line(tmp_path):
    """SIGTERM as soon as both rank actors run: the driver kills them and stops its Ray, prints
    the local launcher's one line and exits 143; no ray:: process outlives it."""
    launcher = _start(tmp_path, steps=60, **RAY)
    beats = tmp_path / "run" / ".heartbeat"
    try:
        processes = _ray_started(launcher, lambda: len(list(beats.glob("rank*.json"))) == 2)
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
        exited_s = time.monotonic() - sent
    finally:
        launcher.kill()
    assert launcher.returncode == 143, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("megarl-train:")]
    assert said == ["megarl-train: stopped by SIGTERM: every rank was stopped"], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    _assert_gone(processes, 1.0)
    assert not (tmp_path / "run" / ".megarl.lock").exists()
    print(f"ray, SIGTERM: {len(processes)} Ray processes stopped, exit 143 in {exited_s:.1f} s")
    assert exited_s < 15


RAY_DRIVER = (
    "import time\n"
    "from megarl.distributed.ray_launcher import connect\n"
    "connect()\n"
    "print('READY', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.slow
def test_no_process_of_a_private_ray_outlives_its_sigkilled_driver_by_10_s():
    """Ray's own agents outlived a SIGKILLed driver by ~61 s; the driver's reaper ends them."""
    driver = subprocess.Popen(
        [sys.executable, "-c", RAY_DRIVER], stdout=subprocess.PIPE, env=run_env(), text=True
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "READY"
        time.sleep(2)  # the agents have started
        processes = psutil.Process(driver.pid).children(recursive=True)
        assert any("Agent" in p.name() for p in processes), [p.name() for p in processes]
        driver.kill()
        driver.wait()
        gone_s = _assert_gone(processes, 10.0)
    finally:
        driver.kill()
    print(f"ray, driver SIGKILLed: {len(processes)} processes gone in {gone_s:.1f} s")


@pytest.mark.slow
def test_ray_frozen_rank_is_named_with_its_phase(tmp_path):
    """Rank 1's loop freezes at step 1 inside its Ray actor; rank 0's collective times out. The
    one line names rank 1, its node and phase (not rank 0's timeout) within the timeout plus a
    margin, and no ray:: process is left."""
    timeout_s = 8
    processes, line, detect_s = _freeze_rank_1(
        tmp_path, 1, timeout_s, lambda launcher, mark: _ray_started(launcher, mark.exists), **RAY
    )
    assert f"actor rank 1 on node {socket.gethostname()} (" in line, line
    assert "failed: stopped responding: no progress for" in line, line
    assert line.endswith("during rollout of step 1; then 1 other rank(s) failed"), line
    _assert_gone(processes, 1.0)
    print(f"ray, rank 1 frozen at step 1 -> exit in {detect_s:.1f} s: {line}")
    assert detect_s < timeout_s + 15

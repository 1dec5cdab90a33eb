"""The reaper of a private Ray: when the driver dies (SIGKILL), the Ray processes below it are
ended at once, not ~61 s later as Ray's own agents end; other processes are left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from megarl.distributed import ray_reaper
from megarl.distributed.processes import command_line, descendants, process_lives

DRIVER = """
(exec -a ray::FakeDashboardAgent sleep 60) &
(exec -a not-ray-helper sleep 60) &
sleep 60
"""


NAMES = {"ray::FakeDashboardAgent", "not-ray-helper"}


def _name(pid: int) -> str:
    words = command_line(pid).split()
    return words[0] if words else ""


def test_the_drivers_ray_processes_end_with_it_and_only_they(tmp_path):
    driver = subprocess.Popen(["bash", "-c", DRIVER])
    try:
        deadline = time.monotonic() + 10
        below: dict[str, int] = {}
        # until both have exec'd (a forked subshell still reads "bash" before its exec)
        while len(below.keys() & NAMES) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
            below = {_name(pid): pid for pid in descendants(driver.pid)}
        agent, helper = below["ray::FakeDashboardAgent"], below["not-ray-helper"]
        killed: list[int] = []
        watcher = threading.Thread(
            target=lambda: killed.extend(ray_reaper.watch(driver.pid, poll_s=0.05))
        )
        watcher.start()
        time.sleep(0.3)  # the reaper has recorded them
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        watcher.join(timeout=5)
        assert killed == [agent]
        time.sleep(0.1)
        assert not process_lives(agent) and process_lives(helper)
    finally:
        driver.kill()
        for pid in (below.get("not-ray-helper"), below.get("ray::FakeDashboardAgent")):
            if pid is not None and process_lives(pid):
                os.kill(pid, signal.SIGKILL)


def test_ray_processes_are_told_by_their_command_line():
    assert ray_reaper.is_ray_process("ray::RuntimeEnvAgent")
    assert ray_reaper.is_ray_process(
        "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x"
    )
    assert not ray_reaper.is_ray_process("python -m megarl.distributed.ray_reaper 12")
    assert not ray_reaper.is_ray_process("sleep 60")


def test_a_driver_starts_one_reaper_and_ends_it_when_it_shuts_its_ray_down():
    reaper = ray_reaper.start()
    try:
        assert reaper is not None and ray_reaper.start() is None  # one per process
        time.sleep(0.2)
        assert reaper.poll() is None and "megarl.distributed.ray_reaper" in command_line(reaper.pid)
    finally:
        ray_reaper.stop()
    assert reaper.poll() is not None

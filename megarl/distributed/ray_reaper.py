"""Ends a private Ray's processes when the driver that started them dies, however it dies.

Ray ends its GCS and raylet with the driver that started them (fate sharing), but its
dashboard and runtime-env agents, on finding their raylet dead without a SIGTERM in its log,
report the death to the GCS -- dead too -- with a fixed 60 s timeout before they exit: after a
SIGKILLed driver they outlive it by ~61 s (measured, Ray 2.60), holding memory and ports. No
code of the driver runs after a SIGKILL, so a small process of its own watches it instead:
:func:`start` (called once the driver starts a private Ray) runs this module as
``python -m megarl.distributed.ray_reaper <driver pid>``, in a session of its own (a signal to
the driver's process group does not reach it). Every :data:`POLL_S` it records the driver's Ray
processes (those below it whose command line is Ray's: ``ray::`` titles, Ray's binaries); when
the driver is gone it SIGKILLs those still running, each only if it is the same process (its
start time unchanged: a recycled pid is someone else's), and exits. A driver that ends normally
has shut Ray down already and ends its reaper (:func:`stop`).

Imports only :mod:`megarl.distributed.processes` and the standard library (it starts in ~20 ms).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megarl.distributed.processes import (
    command_line,
    descendants,
    kill_all,
    process_lives,
    process_start,
)

POLL_S = 0.5
"""How often the reaper looks at the driver and records its Ray processes."""

RAY_MARKERS: tuple[str, ...] = ("ray::", "/ray/", "ray/dashboard", "raylet", "gcs_server")
"""What a command line of Ray's own processes contains (workers and agents retitle themselves
``ray::...``; the GCS, raylet and Python helpers run from Ray's package folder)."""

_started_for: int | None = None
_reaper: subprocess.Popen[bytes] | None = None
"""Kept for the process's life (a dropped Popen of a running child warns)."""


def is_ray_process(command: str) -> bool:
    """Whether ``command`` (a process's command line) is one of Ray's processes."""
    return any(marker in command for marker in RAY_MARKERS)


def start() -> subprocess.Popen[bytes] | None:
    """Watch this process (once per process): its Ray processes end within :data:`POLL_S`
    of its death. None where there is no ``/proc`` to read (no reaper is needed to be exact)."""
    global _started_for, _reaper
    pid = os.getpid()
    if _started_for == pid or not os.path.isdir("/proc"):
        return None
    _started_for = pid
    _reaper = subprocess.Popen(
        [sys.executable, "-m", "megarl.distributed.ray_reaper", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    return _reaper


def stop() -> None:
    """End this process's reaper (its private Ray was shut down); a later :func:`start` starts
    another."""
    global _started_for, _reaper
    reaper, _reaper, _started_for = _reaper, None, None
    if reaper is not None and reaper.poll() is None:
        reaper.terminate()
        reaper.wait(timeout=5)


def watch(driver: int, poll_s: float = POLL_S) -> list[int]:
    """Record ``driver``'s Ray processes until it is gone, then SIGKILL those still running
    (the same processes); returns the pids it killed."""
    driver_start = process_start(driver)
    known: dict[int, int] = {}
    while process_lives(driver) and process_start(driver) == driver_start:
        for pid in descendants(driver):
            if pid not in known and is_ray_process(command_line(pid)):
                start_time = process_start(pid)
                if start_time is not None:
                    known[pid] = start_time
        time.sleep(poll_s)
    left = [pid for pid, started in known.items() if process_start(pid) == started]
    left = [pid for pid in left if process_lives(pid)]
    kill_all(left)
    return left


def main(argv: list[str]) -> int:
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

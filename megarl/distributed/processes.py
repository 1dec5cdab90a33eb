"""What the launcher, the run lock, the sandbox and fault injection ask about processes, read once.

Each question is answered from ``/proc`` (Linux), where the answer is exact and costs no
dependency: whether a pid still runs (a zombie does not: a killed launcher stays one until its
parent collects it, and ``kill(pid, 0)`` still succeeds then), when it started (a recycled pid
is another process), what it runs, and every process below it (so a stopped rank's vLLM engine
core, which outlives its parent, is killed with it). ``/proc/<pid>/stat`` is split after the
last ``)``: the command name inside the parentheses may hold spaces and parentheses itself.
"""

from __future__ import annotations

import contextlib
import os
import signal

DEAD_STATES = frozenset("ZX")
"""``/proc/<pid>/stat`` states of a process that has exited: zombie, dead."""


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if the
    process is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_lives(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie."""
    if os.path.isdir("/proc"):
        fields = stat_fields(pid)
        return fields is not None and fields[0] not in DEAD_STATES
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``)."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields else None


def command_line(pid: int) -> str:
    """``pid``'s command line as one string (a process's own title where it set one, as vLLM's
    engine core does), or "" if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (none where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = stat_fields(int(entry))
            if fields is None or len(fields) < 2:
                continue  # ended meanwhile
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def processes_of_uid(uid: int) -> list[int]:
    """Every live process whose real uid is ``uid`` (a sandbox's private uid), from /proc."""
    pids = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue  # ended meanwhile
            state = status.get("State", "").strip()[:1]
            uids = status.get("Uid", "").split()
            if uids and int(uids[0]) == uid and state not in DEAD_STATES:
                pids.append(int(entry))
    return pids


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` still running."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

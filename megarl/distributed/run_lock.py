"""One run per run directory: a lock file naming the host and pid of the run that holds it.

Two runs writing one ``trainer.run_dir`` would interleave their metrics and checkpoints, and the
second's start-up tidying (``metrics.jsonl`` set aside, later checkpoints renamed) would pull
files from under the first. So the launcher takes ``<run_dir>/.megarl.lock`` once its start-up
checks have passed, before it writes anything there, and removes it when it exits.

The file is created with ``O_CREAT | O_EXCL`` (atomic: of two runs starting together, one wins)
and holds ``{"host", "pid", "pid_start"}``. A lock whose holder is on this host and no longer
alive -- the pid is gone, or now belongs to another process (its start time differs) -- is stale
(a run killed with SIGKILL leaves one) and is taken over with a warning. A live holder, or one on
another host (whose liveness this host cannot see), is refused with one line naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megarl.distributed.processes import process_start
from megarl.errors import BadInputError

LOCK_NAME = ".megarl.lock"


class RunDirBusy(BadInputError):
    """Another live run holds the run directory: refused before anything is written (exit 2)."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock: what the refusal names and what staleness is judged from."""

    host: str
    pid: int
    pid_start: int | None = None
    """The process's start time in clock ticks since boot (Linux), so a pid reused by another
    process is not mistaken for the holder; None where unknown."""

    @classmethod
    def me(cls) -> LockHolder:
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()))

    def is_alive_here(self) -> bool:
        """Whether this process still runs, judged from this host (True if on another host)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return self.pid_start is None or process_start(self.pid) in (None, self.pid_start)


def acquire(run_dir: str | Path) -> Path:
    """Take the lock of ``run_dir`` (creating the folder) or raise :class:`RunDirBusy`."""
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    me = LockHolder.me()
    if _create(path, me):
        return path
    # Judging and replacing a stale lock is serialised, so two runs cannot both take it over.
    with _takeover_guard(path):
        holder = _read(path)
        if holder is None:
            if _create(path, me):  # its holder released it meanwhile
                return path
            raise RunDirBusy(
                f"trainer.run_dir={run_dir}: lock file {path} is unreadable; "
                "remove it if no run uses this folder"
            )
        if holder.is_alive_here():
            other = holder.host != me.host
            hint = " (on another host: remove the lock file if that run is gone)" if other else ""
            raise RunDirBusy(
                f"trainer.run_dir={run_dir}: another run is using it "
                f"(host {holder.host}, pid {holder.pid}){hint}"
            )
        print(
            f"megarl-train: warning: taking over the stale lock of {run_dir} "
            f"(host {holder.host}, pid {holder.pid} is no longer running)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if not _create(path, me):
            raise RunDirBusy(f"trainer.run_dir={run_dir}: another run took it just now")
    return path


@contextlib.contextmanager
def _takeover_guard(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the run directory itself (no file left behind; the kernel
    releases it if this process dies)."""
    import fcntl

    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def release(path: Path) -> None:
    """Remove the lock if it is still this process's (a takeover may have replaced it)."""
    holder = _read(path)
    if holder is not None and (holder.host, holder.pid) == (socket.gethostname(), os.getpid()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold the lock of ``run_dir`` for the ``with`` block (released on any exit but SIGKILL)."""
    path = acquire(run_dir)
    try:
        yield path
    finally:
        release(path)


def _create(path: Path, holder: LockHolder) -> bool:
    """Create the lock file holding ``holder``; False if it exists already."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump({"host": holder.host, "pid": holder.pid, "pid_start": holder.pid_start}, handle)
    return True


def _read(path: Path) -> LockHolder | None:
    """The holder named in a lock file; None if it cannot be read (or is half written)."""
    try:
        data = json.loads(path.read_text())
        return LockHolder(str(data["host"]), int(data["pid"]), data.get("pid_start"))
    except (OSError, ValueError, KeyError, TypeError):
        return None

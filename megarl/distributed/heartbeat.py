"""Heartbeats: each rank says what its main loop is doing, so the launcher can name a stuck rank.

A rank that hangs (a deadlock, a stuck kernel, a frozen process) makes its peers wait in their
next collective; after ``trainer.collective_timeout_s`` they fail with a timeout, which names the
ranks that *noticed*, not the one that stopped. So every rank, under either launcher, runs a
daemon thread that writes ``<run_dir>/.heartbeat/rank{N}.json`` (atomically, every
:data:`WRITE_INTERVAL_S`) with its host, pid, step, the phase its main loop last entered and when
it entered it (a multi-node Ray run needs ``run_dir`` on a file system every node shares, as its
checkpoints do; without one the beats are simply not seen, and failures are named as before).
The thread keeps writing while the main loop is stuck, so the file stays fresh but the progress
time grows old: that age is what the launcher judges.

The launcher (:class:`HeartbeatWatch`; the checks are
:func:`megarl.distributed.launcher.raise_if_stuck`) names the rank whose main loop stopped first:

- when peers fail (e.g. their collective timed out) while a live rank that reported nothing has
  made no progress for half the timeout, and stopped before the failed peers last advanced,
  that rank is named, not the peers;
- when no rank fails but one inside the step loop has made no progress for the timeout plus
  :data:`STALE_GRACE_S` (a collective that never times out), the run is failed naming it. Start-up
  (imports, loading the model, building the engine) is left to the collective timeout and to
  process deaths: its phases can legitimately outlast a short timeout without any rank waiting.

The rank loop marks progress at every phase and every optimizer step; a rank's main loop must
therefore advance within the timeout -- the same bound the collective timeout already puts on a
peer waiting for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megarl import user_code
from megarl.distributed import fault_injection

WRITE_INTERVAL_S = 2.0
STALE_GRACE_S = 10.0
"""Beyond the collective timeout: time for the peers' own timeout errors to arrive first."""


@dataclass(frozen=True)
class Beat:
    """One rank's last report."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    """The phase the main loop last entered (``rollout``, ``update_actor``, ``save``, ...)."""
    progress_at: float
    """Wall-clock time the main loop last advanced (entered a phase or an optimizer step)."""
    user_call: str = ""
    """The user code running at the last report (:func:`megarl.user_code.calls_in_flight`,
    newest first: ``tool python: execute (sample 3)``), published the moment a call starts and
    ends; empty when none ran. A rank that dies inside user code (``os._exit``, a segfault in
    an extension) raises nothing; this is what names the call."""

    @property
    def during(self) -> str:
        """What the main loop was doing: ``update_actor of step 3``, and the user code running
        then (``rollout of step 3, while running tool python: execute (sample 3)``)."""
        during = f"{self.phase} of step {self.step}" if self.step else self.phase
        return f"{during}, while running {self.user_call}" if self.user_call else during

    def describe(self, now: float, with_pid: bool = True) -> str:
        """What went wrong, for the failure line (``with_pid=False`` where it names the pid)."""
        pid = f" (pid {self.pid})" if with_pid else ""
        return (
            f"stopped responding: no progress for {now - self.progress_at:.0f} s "
            f"during {self.during}{pid}"
        )


def beat_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


# --- in each rank ----------------------------------------------------------------------------


class _Writer:
    """The rank's current phase (set by the main loop) and the daemon thread that publishes it."""

    def __init__(self, folder: str, rank: int, interval_s: float):
        self.path = beat_path(folder, rank)
        self.rank, self.interval_s = rank, interval_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self.phase, self.progress_at = 0, "start", time.time()
        self.stopped = threading.Event()
        self._write_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        threading.Thread(target=self._loop, name="megarl-heartbeat", daemon=True).start()
        user_code.set_listener(self.write)  # a user call's start and end, published at once

    def mark(self, phase: str, step: int | None) -> None:
        self.phase, self.progress_at = phase, time.time()
        if step is not None:
            self.step = step
        fault_injection.at_phase(self.rank, self.step, phase)  # tests only; else one lookup

    def write(self) -> None:
        calls = list(user_code.calls_in_flight())
        running = calls[-1] if calls else ""
        if len(calls) > 1:
            running += f" (and {len(calls) - 1} more)"
        beat = Beat(
            self.rank, self.host, self.pid, self.step, self.phase, self.progress_at, running
        )
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}.tmp")
        with self._write_lock:  # the main loop (a user call) and the thread both write
            tmp.write_text(json.dumps(beat.__dict__))
            os.replace(tmp, self.path)

    def _loop(self) -> None:
        while not self.stopped.wait(self.interval_s):
            with contextlib.suppress(OSError):  # a full disk must not kill the rank
                self.write()


_writer: _Writer | None = None


def start(folder: str, rank: int, interval_s: float = WRITE_INTERVAL_S) -> None:
    """Start this rank's heartbeat (once per process)."""
    global _writer
    if _writer is None:
        _writer = _Writer(folder, rank, interval_s)


def stop() -> None:
    """Stop publishing (a process that goes on after its rank's work, e.g. a test)."""
    global _writer
    if _writer is not None:
        _writer.stopped.set()
        user_code.set_listener(None)
        _writer = None


def mark(phase: str, step: int | None = None) -> None:
    """The main loop entered ``phase`` (of ``step``, if given): progress. No-op without start."""
    if _writer is not None:
        _writer.mark(phase, step)


def during() -> str | None:
    """What this rank's main loop is doing (``save of step 3``), or None without a heartbeat."""
    writer = _writer
    if writer is None:
        return None
    return Beat(0, "", 0, writer.step, writer.phase, writer.progress_at).during


@contextlib.contextmanager
def published_on_error() -> Iterator[None]:
    """If the block raises, publish the rank's phase at once, before the error leaves the rank.

    The thread writes every :data:`WRITE_INTERVAL_S`; an error raised soon after a phase began
    would otherwise be reported with the phase before it.
    """
    try:
        yield
    except BaseException:
        if _writer is not None:
            with contextlib.suppress(OSError):
                _writer.write()
        raise


# --- in the launcher -------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatWatch:
    """Where the ranks' heartbeats are, and after how long without progress a rank is stuck."""

    folder: str
    timeout_s: float
    """``trainer.collective_timeout_s``."""

    def reset(self) -> None:
        """Remove the previous run's beats (the launcher starts fresh ranks)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def read(self, pids: dict[int, int]) -> dict[int, Beat]:
        """The beats of ``{rank: pid}`` (a file written by another process is ignored)."""
        beats = {}
        for rank, pid in pids.items():
            try:
                beat = Beat(**json.loads(beat_path(self.folder, rank).read_text()))
            except (OSError, ValueError, TypeError):
                continue
            if beat.pid == pid:
                beats[rank] = beat
        return beats

    def stalest(
        self,
        pids: dict[int, int],
        older_than_s: float,
        failed: dict[int, int] | None = None,
        in_steps_only: bool = False,
    ) -> Beat | None:
        """Of the ranks ``pids`` names, the one whose main loop stopped first, if it has made no
        progress for more than ``older_than_s`` -- and, given the ``failed`` ranks, stopped
        before every one of them last advanced (else their own error came first: a rank waiting
        for a peer that raised is not the cause). ``in_steps_only`` leaves out ranks still
        starting up (step 0: imports, model loading), whose phases are not bounded."""
        now = time.time()
        stuck = [
            b
            for b in self.read(pids).values()
            if now - b.progress_at > older_than_s and (b.step > 0 or not in_steps_only)
        ]
        failed_beats = self.read(failed or {}).values()
        if failed_beats:
            first_failure = min(b.progress_at for b in failed_beats)
            stuck = [b for b in stuck if b.progress_at < first_failure]
        return min(stuck, key=lambda b: (b.progress_at, b.rank), default=None)

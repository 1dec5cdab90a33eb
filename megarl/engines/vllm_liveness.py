"""A vLLM engine core that dies fails the call waiting on it, at once, naming the process.

vLLM's offline engine runs its scheduler and model in an engine-core process. When that process
dies (the out-of-memory killer, a native crash), vLLM's synchronous client notices, marks itself
dead and shuts its output thread down -- but a call already waiting (``LLM.generate``'s
``get_output``, a ``collective_rpc`` weight load's future) waits on a queue or future nobody will
ever fill, and the run hangs forever (measured with vLLM 0.32: 4 of 4 kills during generation).
A call made after the death raises vLLM's ``EngineDeadError``, which says nothing of which process
or why.

:class:`EngineCoreWatch` closes the gap from the outside: a daemon thread waits on the engine-core
processes' sentinels; when one ends while the engine is open, it records :class:`EngineCoreDied`
(process, pid, exit code or signal, and what the engine was doing) and wakes every waiter with
it -- the output queue gets the error (the client raises what it finds there) and pending
utility futures fail with it. :meth:`EngineCoreWatch.named` turns whatever the waiter then raises
(vLLM's ``EngineDeadError`` included) into that one-line error.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

from megarl.errors import MegarlError

POLL_S = 1.0
"""How often the watch thread checks that it should still watch (the engine may be closing)."""

EXIT_CODE_WAIT_S = 2.0
"""How long the watch waits for a dead process's exit code (vLLM's own monitor may reap it)."""


class EngineCoreDied(MegarlError):
    """vLLM's engine-core process ended while the engine was in use (exit 1)."""


def describe_exit(exitcode: int | None) -> str:
    """``-9`` -> ``killed by SIGKILL (as the out-of-memory killer does)``; ``1`` -> ``exit code 1``."""
    if exitcode is None:
        return "ended"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = " (as the out-of-memory killer does)" if -exitcode == signal.SIGKILL else ""
        return f"killed by {name}{oom}"
    return f"exit code {exitcode}"


def exit_code(proc: Any, wait_s: float = EXIT_CODE_WAIT_S) -> int | None:
    """The exit code of a process whose sentinel fired, waiting up to ``wait_s`` for it.

    vLLM's own monitor thread joins the same process when it dies. Two threads reaping one
    child race: the loser's ``waitpid`` fails (the child is gone) and ``exitcode`` reads
    ``None`` until the winner stores the status on the shared process object -- so this reads
    it again until it appears, instead of naming the death ``ended`` without its signal.
    """
    deadline = time.monotonic() + wait_s
    proc.join(timeout=wait_s)
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.exitcode


class EngineCoreWatch:
    """Watches the engine-core processes of one ``vllm.LLM`` (see the module docstring)."""

    def __init__(self, llm: Any) -> None:
        self._client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(self._client, "resources", None), "engine_manager", None)
        self._procs = list(getattr(manager, "processes", ()))
        self._closing = threading.Event()
        self.activity = "starting"
        """What the engine is doing, set by its caller (``generate``, ``update_weights``)."""
        self.death: EngineCoreDied | None = None
        if self._procs:
            threading.Thread(target=self._watch, name="megarl-vllm-watch", daemon=True).start()
        elif "Inproc" not in type(self._client).__name__:  # in-process: nothing to watch
            warnings.warn(
                f"vLLM's engine-core processes were not found on its client "
                f"({type(self._client).__name__}: vLLM's internals changed?): an engine core "
                "that dies will hang the call waiting on it instead of failing it",
                stacklevel=2,
            )

    def stop(self) -> None:
        """The engine is being closed: its processes ending now is no failure."""
        self._closing.set()

    @contextlib.contextmanager
    def named(self, activity: str) -> Iterator[None]:
        """Run an engine call; if the engine core died, raise :class:`EngineCoreDied` instead of
        whatever the call raised (vLLM's ``EngineDeadError``, or the error the watch queued)."""
        self.activity = activity
        if self.death is not None:
            raise self.death
        try:
            yield
        except Exception:
            if self.death is not None:
                raise self.death from None
            raise
        finally:
            self.activity = "idle"

    def _watch(self) -> None:
        sentinels = {proc.sentinel: proc for proc in self._procs}
        while not self._closing.is_set():
            ended = wait(list(sentinels), timeout=POLL_S)
            if ended and not self._closing.is_set():
                proc = sentinels[ended[0]]  # pyright: ignore[reportArgumentType]
                self._fail_waiters(
                    EngineCoreDied(
                        f"vLLM's engine core process {proc.name} (pid {proc.pid}) "
                        f"{describe_exit(exit_code(proc))} during {self.activity}; "
                        "vLLM's log above may say why"
                    )
                )
                return

    def _fail_waiters(self, error: EngineCoreDied) -> None:
        self.death = error
        outputs = getattr(self._client, "outputs_queue", None)
        if outputs is not None:
            outputs.put_nowait(error)  # wakes get_output; the client raises what it finds
        for future in list(getattr(self._client, "utility_results", {}).values()):
            with contextlib.suppress(Exception):  # already done: nothing waits on it
                future.set_exception(error)

"""The boundary around every call into user code: tools, agent loops, reward functions.

User code runs inside the trainer's own process, so whatever it raises reaches the run's
machinery unless something stops it here. Two kinds of exception would otherwise end the run
as if the run itself had asked to:

* ``SystemExit`` -- ``unittest.main()``, ``sys.exit()``, ``argparse`` on bad arguments. Of
  code 0 or ``False`` it would end the run with exit status 0: a scheduler sees success.
* ``KeyboardInterrupt`` raised by the code itself, which would read as Ctrl-C.

Python lets both (and any other ``BaseException`` that is not an ``Exception``) through every
``except Exception``, and an asyncio task re-raises ``SystemExit``/``KeyboardInterrupt`` out of
the event loop even when another coroutine awaits the task. So the conversion must happen
inside the user's call, before the exception leaves it: :func:`user_call` (a context manager,
for the body of a coroutine or a plain call) turns such an exception into
:class:`UserCodeExit`, an ordinary ``Exception`` naming it, which the caller's existing
handling then treats as that call's failure (an error observation for a tool,
``data.reward_error`` for a reward, the sample's failure for a loop). ``Exception``\\ s pass
unchanged, so callers keep their own distinctions (a tool's ``ToolError``).

What is never converted: the run's own stop requests (:func:`is_stop_request`):
:class:`~megarl.errors.RunAborted` (SIGTERM/SIGINT under ``megarl-train``, the hang watch),
an asyncio cancellation of the running task, and ``KeyboardInterrupt`` where SIGINT still has
Python's default handler (megarl used as a library: that is Ctrl-C).

``os._exit`` called inside a user call raises :class:`ProcessExitCalled` instead of ending the
process (:func:`guard_process_exit`, installed by the first :func:`user_call`), so it fails that
call as ``SystemExit`` does. :func:`user_call` also records the call while it runs
(:func:`calls_in_flight`) and tells a listener (the rank's heartbeat, :func:`set_listener`), so
a process that dies inside user code in a way no Python code sees (an extension's own
``_exit``, a segfault) is named by the launcher.

Every call into user code goes through :func:`user_call` -- tools' hooks, agent loops' ``run``
and constructors, reward functions and their import -- and so should any new entry point (an
agent gateway's): ``with user_call("what (sample i)"):`` around the awaited or called user code,
then the caller's usual ``except Exception`` handling, with :func:`describe_user_exception` for
the line.

Pure: imports only :mod:`megarl.errors` and the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
import signal
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

from megarl.errors import RunAborted

MESSAGE_CHARS = 200
"""How much of an exception's message a description keeps (one line)."""


class ProcessExitCalled(BaseException):
    """User code called ``os._exit(code)`` in the trainer's process, inside a user call (see
    :func:`guard_process_exit`): raised in its place, so the call fails instead of the process
    ending with ``code`` -- 0 would be a run that "succeeded" with no step trained."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(f"os._exit({code}) called")


class UserCodeExit(Exception):
    """User code raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ...) and is not a stop request: the failure of that one call, as an
    ``Exception`` the caller's handling catches. ``cause`` (also ``__cause__``, with its
    traceback) is what the code raised."""

    def __init__(self, what: str, cause: BaseException):
        self.what, self.cause = what, cause
        super().__init__(f"{what} raised {describe_user_exception(cause)}")


def describe_user_exception(exc: BaseException, location: bool = True) -> str:
    """``exc`` in one line: class, message (cut to :data:`MESSAGE_CHARS`) and, with
    ``location``, the ``file:line`` of the user's code it came from (:func:`user_location`):
    ``KeyError: 'API_KEY' (at my_rewards.py:12)``. A :class:`UserCodeExit` is described by
    what the code raised; a ``SystemExit`` by its exit code (``SystemExit(0)``)."""
    if isinstance(exc, UserCodeExit):
        exc = exc.cause
    if isinstance(exc, SystemExit):
        text = f"SystemExit({exc.code!r})"
    elif isinstance(exc, ProcessExitCalled):
        text = str(exc)
    else:
        detail = " ".join(str(exc).split())
        if len(detail) > MESSAGE_CHARS:
            detail = detail[: MESSAGE_CHARS - 3] + "..."
        text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    where = user_location(exc) if location else None
    return f"{text} (at {where})" if where else text


def user_location(exc: BaseException) -> str | None:
    """``file:line`` where ``exc`` left the user's code: the innermost frame of its traceback
    outside Python's own library, installed packages and megarl (so ``unittest.main()``'s
    ``SystemExit`` is named at the line that called it); the innermost frame when every frame
    is theirs; None without a traceback. Paths under the working directory are relative."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    own = [f for f in frames if not _is_library(f.filename)]
    frame = (own or frames)[-1]
    return f"{_short(frame.filename)}:{frame.lineno}"


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.add(os.path.dirname(os.path.abspath(__file__)))  # megarl itself
    return tuple(os.path.join(os.path.abspath(root), "") for root in roots)


_LIBRARY_ROOTS = _library_roots()


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARY_ROOTS) or filename.startswith("<frozen ")


def _short(filename: str) -> str:
    path = os.path.abspath(filename)
    cwd = os.path.join(os.getcwd(), "")
    return path[len(cwd) :] if path.startswith(cwd) else filename


def is_stop_request(exc: BaseException) -> bool:
    """Whether ``exc`` is the run being stopped rather than the user's code failing:
    :class:`~megarl.errors.RunAborted`, the cancellation of the running asyncio task (a
    timeout, a failed step unwinding), a generator being closed, and ``KeyboardInterrupt``
    only where SIGINT has Python's default handler (under ``megarl-train`` Ctrl-C raises
    :class:`~megarl.errors.RunStopped` instead, so a ``KeyboardInterrupt`` is the code's)."""
    if isinstance(exc, RunAborted | GeneratorExit):
        return True
    if isinstance(exc, KeyboardInterrupt):
        return signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if isinstance(exc, asyncio.CancelledError):
        return _cancelling()
    return False


def _cancelling() -> bool:
    """Whether the running asyncio task is being cancelled (a cancellation the code raised of
    its own accord is its failure); outside a task, a ``CancelledError`` is taken as one."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return True
    return task is None or task.cancelling() > 0


# --- os._exit inside a user call -----------------------------------------------------------------

_real_exit = os._exit
_guarded_pid: int | None = None


def guard_process_exit() -> None:
    """From now on, ``os._exit`` called by code running inside a :func:`user_call` of this
    process raises :class:`ProcessExitCalled` instead of ending it (the call then fails like
    one that raised). Everywhere else it ends the process as always: in another process (a
    child the code forked: its pid differs), and in threads outside every user call (megarl's
    own watchdogs). Idempotent; :func:`user_call` installs it on its first use. A C extension
    that calls ``_exit`` itself, or a segfault, is not stopped: the heartbeat names the call."""
    global _guarded_pid
    if _guarded_pid == os.getpid():
        return
    _guarded_pid = os.getpid()
    os._exit = _guarded_exit  # type: ignore[assignment]  # restored by nothing: process-wide


def _guarded_exit(code: int) -> NoReturn:
    if os.getpid() == _guarded_pid and _current.get() is not None:
        raise ProcessExitCalled(code)
    _real_exit(code)


# --- calls in flight ----------------------------------------------------------------------------

_lock = threading.Lock()
_in_flight: dict[int, str] = {}
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "megarl_user_call", default=None
)
_tokens = itertools.count()
_listener: Callable[[], None] | None = None


def set_listener(listener: Callable[[], None] | None) -> None:
    """Call ``listener()`` whenever a user call starts or ends (the heartbeat publishes
    :func:`calls_in_flight` at once); None: nobody listens."""
    global _listener
    _listener = listener


def calls_in_flight() -> tuple[str, ...]:
    """What user code is running now, oldest first (``tool python_exec (sample 3)``)."""
    with _lock:
        return tuple(_in_flight.values())


def current_user_call() -> str | None:
    """The innermost user call of this context (this task, or the thread ``asyncio.to_thread``
    started for it), or None: what a worker thread started now is working for."""
    return _current.get()


def _notify() -> None:
    listener = _listener
    if listener is not None:
        with contextlib.suppress(Exception):  # a failed publication must not fail the call
            listener()


@contextlib.contextmanager
def user_call(what: str, record: bool = True, publish: bool = True) -> Iterator[None]:
    """Run the block as a call into user code named ``what`` (``tool calc: execute (sample
    3)``): a ``BaseException`` it raises that is neither an ``Exception`` nor a stop request
    (:func:`is_stop_request`) leaves it as :class:`UserCodeExit`. Put it inside the coroutine
    that awaits the user's, not around the task that runs it: asyncio re-raises ``SystemExit``
    out of the event loop first.

    ``record``: listed in :func:`calls_in_flight` while it runs (off for a call that mostly
    waits on megarl's own work, an agent loop's ``run``: a crash in the engine meanwhile is not
    its); ``publish``: the listener is told at once (off for calls made by the thousand, each
    sample's reward: the heartbeat's own thread publishes them within seconds)."""
    guard_process_exit()
    token = None
    if record:
        with _lock:
            token = next(_tokens)
            _in_flight[token] = what
        if publish:
            _notify()
    current = _current.set(what)
    try:
        yield
    except Exception:
        raise
    except BaseException as exc:
        if is_stop_request(exc):
            raise
        raise UserCodeExit(what, exc) from exc
    finally:
        _current.reset(current)
        if token is not None:
            with _lock:
                del _in_flight[token]
            if publish:
                _notify()


__all__ = [
    "ProcessExitCalled",
    "UserCodeExit",
    "calls_in_flight",
    "current_user_call",
    "describe_user_exception",
    "guard_process_exit",
    "is_stop_request",
    "set_listener",
    "user_call",
    "user_location",
]

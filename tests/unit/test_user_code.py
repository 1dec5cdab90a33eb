"""The boundary around calls into user code: what it converts, what it lets through, how it
names the user's exception, and what it records while a call runs."""

from __future__ import annotations

import asyncio
import io
import signal
import unittest

import pytest

from megarl import user_code
from megarl.errors import RunStopped
from megarl.user_code import (
    UserCodeExit,
    calls_in_flight,
    describe_user_exception,
    is_stop_request,
    user_call,
)


def _raise_here(exc: BaseException) -> None:
    raise exc  # the line a description names


LINE = _raise_here.__code__.co_firstlineno + 1


@pytest.mark.parametrize("exc", [SystemExit(0), SystemExit(False), SystemExit(None), SystemExit(3)])
def test_a_system_exit_of_any_code_is_the_calls_failure_not_the_runs_exit(exc):
    with pytest.raises(UserCodeExit) as failed, user_call("tool t: execute (sample 4)"):
        _raise_here(exc)
    message = str(failed.value)
    assert message.startswith(f"tool t: execute (sample 4) raised SystemExit({exc.code!r})")
    assert f"test_user_code.py:{LINE}" in message
    assert failed.value.__cause__ is exc


def test_unittest_main_is_named_at_the_users_line_not_inside_unittest():
    """A tool that checks code with ``unittest.main()``: its SystemExit(False) is named at the
    line that called it, not inside unittest."""
    with pytest.raises(UserCodeExit) as failed, user_call("tool tests: execute (sample 0)"):
        _calls_unittest_main()
    assert f"SystemExit(False) (at tests/unit/test_user_code.py:{MAIN_LINE})" in str(failed.value)


class _Passes(unittest.TestCase):
    def test_ok(self):
        pass


class _OnlyPasses(unittest.TestLoader):
    def loadTestsFromModule(self, module, *args, **kwargs):
        return self.loadTestsFromTestCase(_Passes)


def _calls_unittest_main() -> None:
    runner = unittest.TextTestRunner(stream=io.StringIO())
    unittest.main(module=None, argv=["t"], testRunner=runner, testLoader=_OnlyPasses())


MAIN_LINE = _calls_unittest_main.__code__.co_firstlineno + 2


def test_exceptions_pass_unchanged_so_callers_keep_their_distinctions():
    error = ValueError("bad")
    with pytest.raises(ValueError) as raised, user_call("x"):
        raise error
    assert raised.value is error


def test_stop_requests_pass(monkeypatch):
    with pytest.raises(RunStopped), user_call("x"):
        raise RunStopped(15)
    # megarl used as a library: SIGINT has Python's handler, so KeyboardInterrupt is Ctrl-C
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt), user_call("x"):
        raise KeyboardInterrupt


def test_under_megarl_train_a_keyboard_interrupt_is_the_codes_own(monkeypatch):
    """megarl-train's SIGINT handler raises RunStopped: a KeyboardInterrupt is user code's."""
    monkeypatch.setattr(signal, "getsignal", lambda sig: lambda *a: None)
    assert not is_stop_request(KeyboardInterrupt())
    with pytest.raises(UserCodeExit, match="raised KeyboardInterrupt"), user_call("x"):
        raise KeyboardInterrupt


def test_a_cancelled_task_passes_but_a_cancellation_raised_by_the_code_is_its_failure():
    async def cancelled_by_timeout():
        async def slow():
            with user_call("slow"):
                await asyncio.sleep(5)

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow(), 0.01)

    async def raises_cancelled():
        with user_call("odd"):
            raise asyncio.CancelledError

    asyncio.run(cancelled_by_timeout())
    with pytest.raises(UserCodeExit, match="odd raised CancelledError"):
        asyncio.run(raises_cancelled())


def test_a_system_exit_inside_a_task_does_not_leave_the_event_loop():
    """Unconverted, asyncio re-raises SystemExit out of ``run_until_complete`` even though the
    awaiting coroutine could catch it; converted inside the coroutine, the caller sees it."""

    async def tool():
        with user_call("tool"):
            raise SystemExit(0)

    async def main():
        try:
            await asyncio.ensure_future(tool())
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__
        return "returned"

    assert asyncio.run(main()) == "UserCodeExit"


def test_calls_in_flight_are_recorded_and_the_listener_told():
    seen: list[tuple[str, ...]] = []
    user_code.set_listener(lambda: seen.append(calls_in_flight()))
    try:
        with user_call("outer"), user_call("inner"):
            assert calls_in_flight() == ("outer", "inner")
        with pytest.raises(UserCodeExit), user_call("fails"):
            raise SystemExit(1)
    finally:
        user_code.set_listener(None)
    assert calls_in_flight() == ()
    assert seen == [("outer",), ("outer", "inner"), ("outer",), (), ("fails",), ()]


def test_descriptions_are_one_line_and_cut():
    exc = ValueError("a\nb " + "x" * 500)
    text = describe_user_exception(exc, location=False)
    assert text.startswith("ValueError: a b xxx") and text.endswith("...")
    assert len(text) <= len("ValueError: ") + user_code.MESSAGE_CHARS and "\n" not in text
    assert describe_user_exception(KeyError()) == "KeyError"


GUARDED = """
import asyncio, os, sys, threading
from megarl.user_code import UserCodeExit, user_call

async def tool():
    with user_call("tool quits: execute (sample 0)"):
        await asyncio.to_thread(os._exit, 0)  # in its worker thread too

try:
    asyncio.run(tool())
except UserCodeExit as exc:
    print("failed:", exc, flush=True)
with user_call("tool forks: execute (sample 1)"):
    if os.fork() == 0:  # a child the code forked ends as it asked
        os._exit(7)
_, status = os.wait()
print("child exit:", os.waitstatus_to_exitcode(status), flush=True)
threading.Thread(target=os._exit, args=(3,)).start()  # outside every user call: ends it
threading.Event().wait(10)
"""


def test_os_exit_inside_a_user_call_fails_the_call_and_only_there():
    """``os._exit(0)`` in a tool would end a one-process run with status 0, no step trained."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(
        "failed: tool quits: execute (sample 0) raised os._exit(0) called"
    ), done.stdout
    assert lines[1] == "child exit: 7"

"""The sandbox for model-written code, against hostile programs: each ends as a result within
its limits and leaves nothing behind (no process, no folder), and it cannot see the trainer's
environment, read the run's files, write outside its folder or reach the network.

A check whose protection this machine does not give is skipped with the sandbox's own statement
of what is missing (``SandboxReport.missing``), never passed vacuously.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from megarl.agent.sandbox import (
    SandboxLimits,
    SandboxReport,
    SandboxResult,
    SandboxUnavailable,
    probe,
    run_python,
)
from megarl.agent.tools.base import ToolError
from megarl.agent.tools.python_exec import (
    PYTHON_EXEC_SCHEMA,
    PythonExecTool,
    format_observation,
)
from megarl.distributed.processes import process_lives

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

LIMITS = SandboxLimits(timeout_s=2, cpu_s=1, memory_mb=256, max_processes=8, max_output_bytes=4096)


@pytest.fixture(scope="module")
def report() -> SandboxReport:
    return asyncio.run(probe())


@pytest.fixture
def work_root() -> Iterator[str]:
    """Where the run's temporary folder goes: checked empty afterwards (nothing left)."""
    root = tempfile.mkdtemp(prefix="megarl-sandbox-test-", dir="/tmp")
    os.chmod(root, 0o711)
    yield root
    leftovers = os.listdir(root)
    shutil.rmtree(root)
    assert leftovers == [], f"sandbox folders left behind: {leftovers}"


def run(code: str, work_root: str, limits: SandboxLimits = LIMITS, **kw: object) -> SandboxResult:
    result = asyncio.run(run_python(code, limits, work_root=work_root, **kw))  # type: ignore[arg-type]
    assert_nothing_left(result)
    return result


def processes_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:  # not a process, or it just ended
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) == uid:
            pids.append(int(entry))
    return pids


def assert_nothing_left(result: SandboxResult) -> None:
    if result.report.uid is not None:
        assert processes_of_uid(result.report.uid) == []


def need(report: SandboxReport, *requirements: str) -> None:
    if not any(report.satisfies(r) for r in requirements):
        pytest.skip(f"this machine's sandbox lacks {requirements}: {report.missing}")


def attempt(setup: str, action: str, done: str) -> str:
    """A program that runs ``setup``, then tries ``action`` (lines) and prints ``done``; an
    :class:`OSError` instead prints ``BLOCKED`` and the error: how the tests of what the
    sandbox refuses (a connection, a signal) see the refusal from inside."""
    body = "".join(f"    {line}\n" for line in action.splitlines())
    return (
        f"{setup}\ntry:\n{body}    print({done!r})\n"
        "except OSError as e:\n    print('BLOCKED', type(e).__name__, e.errno)"
    )


def assert_nothing_arrived(listener: socket.socket) -> None:
    """No connection (a stream socket) or datagram reached ``listener``."""
    listener.setblocking(False)
    datagram = listener.type == socket.SOCK_DGRAM
    with pytest.raises(BlockingIOError):
        listener.recv(16) if datagram else listener.accept()  # nobody knocked


@contextlib.contextmanager
def unix_service(folder_mode: int) -> Iterator[Path]:
    """A listening Unix socket anyone may use (mode 0777, like Ray's), in a new folder under
    /tmp of ``folder_mode``; on leaving, nothing may have reached it, and both are removed."""
    folder = Path(tempfile.mkdtemp(prefix="megarl-sock-", dir="/tmp"))
    folder.chmod(folder_mode)
    path = folder / "service.sock"
    try:
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            path.chmod(0o777)
            server.listen()
            yield path
            assert_nothing_arrived(server)
    finally:
        path.unlink(missing_ok=True)
        folder.rmdir()


# ---------------------------------------------------------------------------------------------
# Normal programs


def test_output_exit_code_and_stderr(work_root: str) -> None:
    code = "import os, sys\nprint('hello', os.listdir('.'))\nprint('oops', file=sys.stderr)\nsys.exit(3)"
    result = run(code, work_root)
    assert result.stdout == "hello []\n"  # an empty folder as cwd
    assert result.stderr == "oops\n"
    assert (result.exit_code, result.killed_by, result.timed_out, result.ok) == (
        3,
        None,
        False,
        False,
    )
    assert not result.truncated
    assert {"clean-env", "isolated-python", "new-session", "rlimits"} <= set(result.report.applied)


def test_success_and_traceback(work_root: str) -> None:
    assert run("print(sum(range(10)))", work_root).ok
    result = run("1 / 0", work_root)
    assert result.exit_code == 1
    assert "ZeroDivisionError" in result.stderr


def test_output_is_capped(work_root: str) -> None:
    result = run("print('x' * 100_000)\nprint('never')", work_root)
    assert result.truncated
    assert result.stdout == "x" * LIMITS.max_output_bytes
    assert result.killed_by == "output_limit"


def test_concurrent_runs_are_separate(work_root: str) -> None:
    async def many() -> list[SandboxResult]:
        codes = [f"print({i} * 2)" for i in range(4)]
        return await asyncio.gather(*(run_python(c, LIMITS, work_root=work_root) for c in codes))

    results = asyncio.run(many())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(4)]
    uids = [r.report.uid for r in results]
    if uids[0] is not None:
        assert len(set(uids)) == 4  # a fresh uid each: one run cannot touch another


def test_a_run_cancelled_while_it_starts_ends_and_leaves_nothing(
    work_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trajectory cancelled (another one failed the step) while its tool's sandbox starts:
    Python 3.11's ``create_subprocess_exec``, cancelled while it connects the pipes, waits
    forever. The start here behaves so -- cancelled before it returns, it never returns -- and
    the cancelled run must still end at once, its launcher killed and its folder removed."""
    real = asyncio.create_subprocess_exec
    launched: list[asyncio.subprocess.Process] = []
    starting = asyncio.Event()

    async def start_as_python_311_does(*args: object, **kwargs: object):
        proc = await real(*args, **kwargs)  # type: ignore[arg-type]
        launched.append(proc)
        starting.set()
        try:
            await asyncio.sleep(0.5)  # the pipes still connecting
        except asyncio.CancelledError:
            await asyncio.Event().wait()  # waits for an exit it is never told of
        return proc

    monkeypatch.setattr(asyncio, "create_subprocess_exec", start_as_python_311_does)

    async def cancelled_while_starting() -> bool:
        limits = SandboxLimits(timeout_s=30)
        task = asyncio.ensure_future(run_python("print(1)", limits, work_root=work_root))
        await starting.wait()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        return bool(done) and task.cancelled()

    assert asyncio.run(cancelled_while_starting())
    [launcher] = launched
    assert not process_lives(launcher.pid)  # killed by the run's cleanup; work_root is empty


def test_installed_packages_importable(work_root: str) -> None:
    pytest.importorskip("numpy")
    limits = SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512, max_processes=8)
    result = run("import numpy as np\nprint(np.arange(5).sum())", work_root, limits)
    assert result.stdout == "10\n", result.stderr


# ---------------------------------------------------------------------------------------------
# Hostile programs: resources


def test_infinite_loop_is_stopped(work_root: str) -> None:
    result = run("while True:\n    pass", work_root)
    assert result.exit_code is None
    assert result.killed_by in ("SIGXCPU", "SIGKILL", "timeout")  # CPU limit, or wall clock
    assert result.duration_s < LIMITS.timeout_s + 2


def test_sleeper_times_out_with_partial_output(work_root: str) -> None:
    limits = SandboxLimits(timeout_s=1, cpu_s=1, memory_mb=256)
    result = run("import time\nprint('started')\ntime.sleep(60)", work_root, limits)
    assert result.timed_out and result.killed_by == "timeout" and result.exit_code is None
    assert result.stdout == "started\n"
    assert result.duration_s < 4


def test_memory_hog_fails_inside(work_root: str) -> None:
    # the memory limit is what stops it: a wall-clock budget a loaded machine cannot exhaust
    limits = dataclasses.replace(LIMITS, timeout_s=20)
    result = run("x = bytearray(2 * 1024**3)\nprint(len(x))", work_root, limits)
    assert result.exit_code == 1
    assert "MemoryError" in result.stderr


def test_process_limit(work_root: str, report: SandboxReport) -> None:
    need(report, "rlimit-nproc")
    code = (
        "import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n"
        "        os._exit(0)\n    n += 1\nprint(n)"
    )
    result = run(
        code, work_root, SandboxLimits(timeout_s=3, cpu_s=1, memory_mb=256, max_processes=8)
    )
    assert int(result.stdout) == 7  # itself and 7 children: max_processes


def test_fork_bomb_leaves_no_process(work_root: str, report: SandboxReport) -> None:
    need(report, "processes")  # a fork bomb without containment would hurt this machine
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    limits = SandboxLimits(timeout_s=1.5, cpu_s=1, memory_mb=128, max_processes=16)
    result = run(code, work_root, limits)  # run() asserts no process of its uid is left
    assert result.killed_by in ("timeout", "SIGXCPU", "SIGKILL")
    if result.report.uid is None:
        pytest.skip("no private uid: nothing to scan /proc for")


def test_setsid_daemon_dies_with_the_run(work_root: str, report: SandboxReport) -> None:
    need(report, "processes")
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(60)\n    os._exit(0)\nprint('parent done')"
    )
    result = run(code, work_root)
    assert result.ok and result.stdout == "parent done\n"
    if result.report.uid is None:
        pytest.skip("no private uid: nothing to scan /proc for")


# ---------------------------------------------------------------------------------------------
# Hostile programs: what they may see and touch


def test_trainer_environment_is_invisible(work_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGARL_SANDBOX_TEST_SECRET", "hunter2-do-not-leak")
    code = (
        "import os\nprint(dict(os.environ))\nfor p in ('/proc/self/environ', '/proc/1/environ',"
        f" '/proc/{os.getpid()}/environ'):\n    try:\n        print(open(p, 'rb').read())\n"
        "    except OSError as e:\n        print(p, type(e).__name__)"
    )
    result = run(code, work_root)
    assert result.ok, result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert "MEGARL_SANDBOX_TEST_SECRET" not in result.stdout


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A stand-in for the run's folder that file permissions alone would not protect:
    world-readable and world-writable, in /tmp."""
    path = Path(tempfile.mkdtemp(prefix="megarl-run-", dir="/tmp"))
    path.chmod(0o777)
    (path / "secret.txt").write_text("topsecret-run-file")
    (path / "secret.txt").chmod(0o666)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_run_files_are_unreadable(work_root: str, report: SandboxReport, run_dir: Path) -> None:
    need(report, "filesystem")
    targets = [run_dir / "secret.txt", Path(__file__).resolve(), Path(sys.prefix) / "pyvenv.cfg"]
    code = (
        f"for p in {[str(t) for t in targets[:2]]}:\n    try:\n"
        "        print('READ', open(p).read()[:40])\n    except OSError as e:\n"
        "        print('DENIED', type(e).__name__)\n"
        f"import os\ntry:\n    print('LISTED', os.listdir({str(run_dir)!r}))\n"
        "except OSError as e:\n    print('DENIED', type(e).__name__)"
    )
    result = run(code, work_root)
    assert result.ok, result.stderr
    assert "READ" not in result.stdout and "LISTED" not in result.stdout
    assert "topsecret" not in result.stdout
    assert result.stdout.count("DENIED") == 3


def test_cannot_write_outside_its_folder(
    work_root: str, report: SandboxReport, run_dir: Path
) -> None:
    need(report, "filesystem")
    outside = [run_dir / "planted.txt", run_dir / "secret.txt", Path("/tmp/megarl-escape.txt")]
    code = (
        f"for p in {[str(t) for t in outside]}:\n    try:\n"
        "        open(p, 'w').write('pwned')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('DENIED', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
    )
    result = run(code, work_root)
    assert result.ok, result.stderr
    assert "WROTE" not in result.stdout and result.stdout.endswith("fine\n")
    assert not (run_dir / "planted.txt").exists() and not outside[2].exists()
    assert (run_dir / "secret.txt").read_text() == "topsecret-run-file"


@pytest.mark.parametrize(
    ("kind", "needs", "setup", "action", "done"),
    [
        pytest.param(
            socket.SOCK_STREAM,
            ("network", "landlock-net"),
            "import socket",
            "socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "CONNECTED",
            id="tcp",
        ),
        pytest.param(  # Landlock alone blocks TCP only: this needs a network namespace
            socket.SOCK_DGRAM,
            ("network",),
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
            "s.sendto(b'leak', ('127.0.0.1', {port}))",
            "SENT",
            id="udp",
        ),
    ],
)
def test_no_traffic_to_the_host(
    kind: int,
    needs: tuple[str, ...],
    setup: str,
    action: str,
    done: str,
    work_root: str,
    report: SandboxReport,
) -> None:
    need(report, *needs)
    with socket.socket(socket.AF_INET, kind) as listener:
        listener.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            listener.listen()
        code = attempt(setup, action.format(port=listener.getsockname()[1]), done)
        result = run(code, work_root)
        assert_nothing_arrived(listener)
    assert result.stdout.startswith("BLOCKED"), result.stdout + result.stderr


def test_host_unix_sockets_unreachable(work_root: str, report: SandboxReport) -> None:
    need(report, "private-root")  # Landlock alone does not control connect() to a socket path
    with unix_service(0o777) as path:
        code = attempt(
            "import socket",
            f"s = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})",
            "CONNECTED",
        )
        result = run(code, work_root)
    assert result.stdout.startswith("BLOCKED"), result.stdout + result.stderr


def test_cannot_signal_the_trainer(work_root: str, report: SandboxReport) -> None:
    need(report, "processes", "landlock-scope")
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        code = attempt("import os, signal", f"os.kill({os.getpid()}, signal.SIGUSR1)", "SENT")
        result = run(code, work_root)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert result.stdout.startswith("BLOCKED") and received == []


def test_require(work_root: str, report: SandboxReport) -> None:
    wanted = ("network", "filesystem", "processes")
    if all(report.satisfies(r) for r in wanted):
        assert run("print(1)", work_root, require=wanted).stdout == "1\n"
    else:
        with pytest.raises(SandboxUnavailable):
            run("print(1)", work_root, require=wanted)
    with pytest.raises(ValueError, match="unknown sandbox requirements"):
        run("print(1)", work_root, require=("magic",))


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="positive"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="integer"):
        SandboxLimits(memory_mb=1.5)  # type: ignore[arg-type]
    assert SandboxLimits.from_config({"cpu_s": 2, "other": 1}).cpu_s == 2


# ---------------------------------------------------------------------------------------------
# The python tool, end to end


def test_python_tool_end_to_end() -> None:
    tool = PythonExecTool({"timeout_s": 1.5, "cpu_s": 1, "memory_mb": 256})
    assert tool.name == "python" and tool.tool_schema == PYTHON_EXEC_SCHEMA
    assert tool.limits.timeout_s == 1.5

    async def calls() -> list[str]:
        state = await tool.create({})
        try:
            return list(
                await asyncio.gather(
                    tool.execute({"code": "print(6 * 7)"}, state),
                    tool.execute({"code": "import sys\nprint('a')\nsys.exit('bad')"}, state),
                    tool.execute({"code": "x = 1"}, state),
                    tool.execute({"code": "import time\ntime.sleep(30)"}, state),
                )
            )
        finally:
            await tool.release(state)

    ok, failed, silent, slow = asyncio.run(calls())
    assert ok == "42"
    assert failed == "a\n\n[stderr]\nbad\n\n[exit status 1]"
    assert silent == "[no output]"
    assert slow == "[timed out after 1.5 s; the program was killed]"


def _result(**kw: object) -> SandboxResult:
    fields: dict = {
        "stdout": "",
        "stderr": "",
        "exit_code": 0,
        "timed_out": False,
        "killed_by": None,
        "truncated": False,
        "report": SandboxReport(applied=()),
    }
    return SandboxResult(**{**fields, **kw})


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (_result(stdout="7\n", stderr="a warning\n"), "7"),
        (_result(stderr="a warning\n"), "[stderr]\na warning"),
        (
            _result(exit_code=None, killed_by="SIGXCPU", stdout="1\n"),
            "1\n\n[killed by SIGXCPU (CPU time limit)]",
        ),
        (
            _result(exit_code=None, killed_by="output_limit", stdout="x" * 5, truncated=True),
            "xxxxx\n[output truncated after 16384 bytes; the program was stopped]",
        ),
        (_result(exit_code=2), "[exit status 2]"),
        (
            _result(stdout="\x1b]0;owned\x07\x1b[2J\x00\tok\r\n", stderr="\x9b31m", exit_code=1),
            "\\x1b]0;owned\\x07\\x1b[2J\\x00\tok\\x0d\n\n[stderr]\n\\x9b31m\n[exit status 1]",
        ),
    ],
)
def test_python_tool_observation(result: SandboxResult, expected: str) -> None:
    assert format_observation(result, SandboxLimits()) == expected


@pytest.mark.parametrize("arguments", [{}, {"code": 5}, {"code": "  "}, {"script": "print(1)"}])
def test_python_tool_bad_arguments(arguments: dict) -> None:
    with pytest.raises(ToolError, match="code"):
        asyncio.run(PythonExecTool().execute(arguments, None))


def test_python_tool_config() -> None:
    with pytest.raises(ToolError, match="at most 10"):
        asyncio.run(PythonExecTool({"max_code_bytes": 10}).execute({"code": "x" * 11}, None))
    with pytest.raises(ValueError, match="unknown config keys"):
        PythonExecTool({"timeout": 3})
    with pytest.raises(ValueError, match="require"):
        PythonExecTool({"require": ["everything"]})
    assert PythonExecTool({"type": "native"}).limits == SandboxLimits()


# ---------------------------------------------------------------------------------------------
# Hostile programs: kernel state, memory outside the address space, privilege, liveness

# The probes below end by themselves: a timeout that a loaded machine's start-up cannot reach.
PATIENT = SandboxLimits(timeout_s=20, cpu_s=2, memory_mb=256, max_processes=8)
# ctypes glue the probes share: a raw system call that reports its errno.
SYSCALL = (
    "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def sys_call(nr, *args):\n    ctypes.set_errno(0)\n    r = libc.syscall(nr, *args)\n"
    "    return r, errno.errorcode.get(ctypes.get_errno(), '0') if r < 0 else 'OK'\n"
)
KEYCTL_JOIN_SESSION_KEYRING = 1
KEYCTL_INVALIDATE = 21


def _keyctl(*args: int | bytes | None) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(250, *args)  # keyctl (x86-64)
    if result < 0:
        raise OSError(ctypes.get_errno(), "keyctl")
    return result


def _add_key(description: bytes, payload: bytes, keyring: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(248, b"user", description, payload, len(payload), keyring)
    if result < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    return result


def need_x86_64() -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the probes call x86-64 system call numbers")


def test_trainer_session_keyring_is_out_of_reach(work_root: str) -> None:
    """The trainer's session keyring (PAM logins, systemd services) holds a key; the program
    neither reads it nor can revoke or clear it."""
    need_x86_64()
    _keyctl(KEYCTL_JOIN_SESSION_KEYRING, b"megarl-sandbox-test")  # this test process's own
    key = _add_key(b"megarl-secret", b"hunter2-keyring", -3)  # KEY_SPEC_SESSION_KEYRING
    try:
        code = SYSCALL + (
            "buf = ctypes.create_string_buffer(256)\n"
            "found = libc.syscall(250, 10, -3, b'user', b'megarl-secret', 0)\n"  # KEYCTL_SEARCH
            "print('search', found)\n"
            f"r = libc.syscall(250, 11, {key}, buf, 256)\n"  # KEYCTL_READ, by id
            "print('read', r, buf.raw[:max(r, 0)])\n"
            "print('clear', sys_call(250, 7, -3))\n"  # KEYCTL_CLEAR the session keyring
            f"print('revoke', sys_call(250, 3, {key}))\n"
        )
        result = run(code, work_root, PATIENT)
        assert result.ok, result.stderr
        assert "hunter2" not in result.stdout
        assert "'OK'" not in result.stdout, result.stdout
        assert _keyctl(11, key, None, 0) == len(b"hunter2-keyring")  # still there, unrevoked
    finally:
        _keyctl(KEYCTL_INVALIDATE, key)


def key_users() -> dict[int, int]:
    """uid -> number of keys it owns, for every uid that owns any (``/proc/key-users``)."""
    users = {}
    for line in Path("/proc/key-users").read_text().splitlines():
        uid, _, rest = line.partition(":")
        users[int(uid)] = int(rest.split()[2].split("/")[0])
    return users


def test_keys_a_program_adds_do_not_outlive_it(work_root: str, report: SandboxReport) -> None:
    """Keys live in the kernel, not in a process: one added under the run's fresh uid would
    stay after the call, and each call has a new uid."""
    need_x86_64()
    need(report, "private-uid")  # otherwise the uid is the trainer's: its keys are not the run's
    code = SYSCALL + (
        "for ring in (-4, -5, -3):\n"  # user, user-session, session keyrings
        "    print(sys_call(248, b'user', b'leftover', b'x' * 100, 100, ring))\n"
    )
    result = run(code, work_root, PATIENT)
    assert result.ok, result.stderr
    assert "'OK'" not in result.stdout, result.stdout
    assert result.report.uid not in key_users()


def test_namespaces_mounts_and_kernel_interfaces_refused(
    work_root: str, report: SandboxReport
) -> None:
    """The first steps of kernel exploits: a new user namespace (full capabilities inside),
    mounts, ptrace, bpf, perf, userfaultfd, io_uring, modules, kexec, keyrings. Arguments are
    such that the kernel itself would answer EFAULT/EINVAL/EBADF: EPERM is the filter."""
    need_x86_64()
    need(report, "seccomp")
    calls = {
        "unshare(NEWUSER)": (272, 0x10000000),
        "unshare(NEWNS)": (272, 0x00020000),
        "clone(NEWUSER)": (56, 0x10000000 | 17, 0, 0, 0, 0),
        "setns": (308, -1, 0),
        "mount": (165, 0, 0, 0, 0, 0),
        "umount2": (166, 0, 0),
        "pivot_root": (155, 0, 0),
        "ptrace(TRACEME)": (101, 0, 0, 0, 0),
        "bpf": (321, 0, 0, 0),
        "perf_event_open": (298, 0, 0, -1, -1, 0),
        "userfaultfd": (323, 0),
        "io_uring_setup": (425, 0, 0),
        "init_module": (175, 0, 0, 0),
        "finit_module": (313, -1, 0, 0),
        "kexec_load": (246, 0, 0, 0, 0),
        "add_key": (248, 0, 0, 0, 0, 0),
        "keyctl": (250, 0, -3, 0),
        "memfd_create": (319, 0, 0),
    }
    code = SYSCALL + f"for name, args in {calls!r}.items():\n    print(name, sys_call(*args)[1])\n"
    result = run(code, work_root, PATIENT)
    assert result.ok, result.stderr
    answers = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
    assert answers == dict.fromkeys(calls, "EPERM")


def test_address_families_outside_the_network_namespace_refused(work_root: str) -> None:
    """AF_VSOCK reaches the hypervisor's channel on a VM; AF_PACKET, AF_NETLINK, AF_ALG (the
    kernel's crypto API) and the like are kernel surface a program never needs. AF_INET(6)
    stay: the network namespace isolates them. UNIX socket pairs stay (asyncio needs one)."""
    code = (
        "import socket\nfor name in ('AF_VSOCK', 'AF_PACKET', 'AF_NETLINK', 'AF_ALG', "
        "'AF_KEY', 'AF_UNIX'):\n    try:\n"
        "        s = socket.socket(getattr(socket, name), socket.SOCK_DGRAM if name == "
        "'AF_NETLINK' else socket.SOCK_SEQPACKET if name == 'AF_ALG' else socket.SOCK_STREAM)\n"
        "        if name == 'AF_VSOCK':\n            s.bind((socket.VMADDR_CID_ANY, 4321))\n"
        "        print(name, 'OPEN')\n    except OSError as e:\n        print(name, 'BLOCKED')\n"
        "socket.socket(socket.AF_INET6).close()\na, b = socket.socketpair()\na.sendall(b'ok')\n"
        "print(b.recv(2).decode())\nimport asyncio\nprint(asyncio.run(asyncio.sleep(0, 'loop')))"
    )
    result = run(code, work_root, PATIENT)
    assert result.ok, result.stderr
    assert "OPEN" not in result.stdout, result.stdout
    assert result.stdout.endswith("ok\nloop\n")


def test_unix_socket_in_a_read_path_unreachable(work_root: str) -> None:
    """A service socket anyone may use (mode 0777), in a folder the program may read."""
    with unix_service(0o755) as path:
        code = (
            "import socket\nfor kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):\n    try:\n"
            "        s = socket.socket(socket.AF_UNIX, kind)\n"
            f"        s.connect({str(path)!r})\n        print('CONNECTED')\n"
            "    except OSError as e:\n        print('BLOCKED', type(e).__name__)"
        )
        result = run(code, work_root, PATIENT, read_paths=[str(path.parent)])
    assert result.stdout.count("BLOCKED") == 2, result.stdout + result.stderr


MEMORY_64 = SandboxLimits(timeout_s=20, cpu_s=10, memory_mb=64, max_processes=8)


def assert_holds_at_most_64_mb(code: str, work_root: str) -> None:
    """Run ``code`` under :data:`MEMORY_64`; it must end well and print the MiB it managed to
    hold as its last word, which must be within the limit."""
    result = run(code, work_root, MEMORY_64)
    assert result.ok, result.stderr
    assert int(result.stdout.split()[-1]) <= 64, result.stdout


def test_memfd_memory_beyond_the_limit_refused(work_root: str) -> None:
    """Memory written into memfds (never mapped) is not address space: 4x ``memory_mb``."""
    code = (
        "import os\nheld, fds = 0, []\nchunk = b'x' * (1 << 20)\n"
        "while held < 4 * 64:\n    try:\n        fd = os.memfd_create('hold')\n"
        "        for _ in range(16):\n            os.write(fd, chunk)\n            held += 1\n"
        "            if held >= 4 * 64:\n                break\n        fds.append(fd)\n"
        "    except OSError as e:\n        print('stopped', e.errno)\n        break\n"
        "print('held', held)"
    )
    assert_holds_at_most_64_mb(code, work_root)


def test_sysv_shared_memory_bounded_by_memory_mb(work_root: str, report: SandboxReport) -> None:
    """SysV segments hold memory while nothing maps them (attach, fill, detach, repeat).
    Bounded by the IPC namespace's limits, or refused by the filter where it has none."""
    need(report, "ipc-limits", "seccomp")
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmat.restype = ctypes.c_void_p\nheld = 0\nsize = 8 << 20\n"
        "while held < 4 * 64:\n    sid = libc.shmget(0, size, 0o1600)\n"  # IPC_PRIVATE, IPC_CREAT
        "    if sid < 0:\n        print('stopped', ctypes.get_errno())\n        break\n"
        "    addr = libc.shmat(sid, None, 0)\n    if addr in (None, ctypes.c_void_p(-1).value):\n"
        "        print('no attach', ctypes.get_errno())\n        break\n"
        "    ctypes.memset(addr, 1, size)\n    libc.shmdt(ctypes.c_void_p(addr))\n"
        "    held += size >> 20\nprint('held', held)"
    )
    assert_holds_at_most_64_mb(code, work_root)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_output_cap_ends_the_call_at_once_and_leaves_no_fd(work_root: str) -> None:
    """A program that keeps printing after the cap: the call returns as soon as the run is
    killed (not at the timeout plus grace), and the trainer holds no pipe of it afterwards."""
    limits = SandboxLimits(timeout_s=10, cpu_s=10, memory_mb=256, max_output_bytes=4096)
    code = (  # a 1 MiB pipe: the reader has more than a stream's buffer limit at once
        "import fcntl, sys\nfcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 1 << 20)\n"
        "while True:\n    sys.stdout.write('x' * (1 << 20))\n    sys.stderr.write('y')"
    )
    before = open_fds()
    result = run(code, work_root, limits)
    assert open_fds() == before
    assert result.killed_by == "output_limit" and result.truncated
    assert result.stdout == "x" * 4096
    assert result.duration_s < 4, result.duration_s


def test_python_tool_shows_control_characters_escaped() -> None:
    """Terminal escape sequences and NUL bytes a program prints reach the model (and every log
    and terminal that shows its context) as text, not as controls."""
    tool = PythonExecTool({"timeout_s": 5, "cpu_s": 2, "memory_mb": 256})
    code = "import sys\nsys.stdout.write('\\x1b[2J\\x1b]0;t\\x07a\\x00b\\x9b\\n')"
    observation = asyncio.run(tool.execute({"code": code}, None))
    assert observation == "\\x1b[2J\\x1b]0;t\\x07a\\x00b\\x9b"
    assert not any(ord(c) < 32 and c not in "\t\n" for c in observation)


def test_seccomp_filter_is_claimed_only_where_it_is_written_for() -> None:
    from megarl.agent.sandbox import seccomp

    assert seccomp.supported("aarch64") is not None  # other numbers: no filter, layer missing
    assert seccomp.supported("x86_64") is None or os.uname().machine != "x86_64"
    assert len(seccomp.program()) % 8 == 0  # whole struct sock_filter entries
    too_far = [(0x15, "end", 0, 0), *[(0x06, 0, 0, 0)] * 256, ("end", 0, 0, 0), (0x06, 0, 0, 0)]
    with pytest.raises(ValueError, match="out of range"):
        seccomp.assemble(too_far)


def test_require_syscalls(work_root: str, report: SandboxReport) -> None:
    if report.satisfies("syscalls"):
        assert run("print(1)", work_root, PATIENT, require=("syscalls", "seccomp")).ok
    else:
        with pytest.raises(SandboxUnavailable, match="seccomp"):
            run("print(1)", work_root, PATIENT, require=("syscalls",))
    assert PythonExecTool({"require": ["syscalls", "ipc-limits"]}).require == (
        "syscalls",
        "ipc-limits",
    )


def test_folders_of_a_killed_trainer_are_swept_and_nothing_else(work_root: str) -> None:
    """A trainer SIGKILLed mid-call leaves its run folder; the next process's first run in that
    work root removes it, and only it: not a folder of the same name without an owner file,
    not one whose owner (this process) runs, not any other file."""
    import subprocess
    import time

    code = (
        "import asyncio\nfrom megarl.agent.sandbox import SandboxLimits, run_python\n"
        "asyncio.run(run_python('import time\\ntime.sleep(60)', SandboxLimits(timeout_s=60), "
        f"work_root={work_root!r}))"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], env={**os.environ})
    try:
        deadline = time.monotonic() + 30
        while not list(Path(work_root).glob("megarl-sandbox-*/owner.json")):
            assert time.monotonic() < deadline and trainer.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)  # the launcher started: its mounts are in its own namespace
    finally:
        trainer.kill()
        trainer.wait()
    [left] = Path(work_root).glob("megarl-sandbox-*")
    foreign = Path(work_root, "megarl-sandbox-not-ours")
    foreign.mkdir()
    (foreign / "data.txt").write_text("keep")
    live = Path(work_root, "megarl-sandbox-live")
    live.mkdir()
    from megarl.distributed.processes import process_start

    start = process_start(os.getpid())
    (live / "owner.json").write_text(f'{{"pid": {os.getpid()}, "start": {start}}}')
    (Path(work_root) / "megarl-sandbox-file").write_text("keep")
    try:
        assert run("print(1)", work_root, PATIENT).stdout == "1\n"
        assert not left.exists()
        assert (foreign / "data.txt").read_text() == "keep" and (live / "owner.json").exists()
        assert (Path(work_root) / "megarl-sandbox-file").exists()
    finally:
        shutil.rmtree(foreign)
        shutil.rmtree(live)
        (Path(work_root) / "megarl-sandbox-file").unlink()


def test_cgroup_bounds_the_program_as_a_whole(work_root: str, report: SandboxReport) -> None:
    """Four processes of 32 MiB each, each within its ``RLIMIT_AS`` of 64 MiB: twice
    ``memory_mb`` for the program. A cgroup counts them together and kills the program; where
    none can be made, the report says why."""
    if not report.satisfies("cgroup"):
        assert [m for m in report.missing if m.startswith("cgroup: ")], report.missing
        pytest.skip(f"no cgroup here: {report.missing}")
    code = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        break\n"
        "held = b'x' * (32 << 20)\ntime.sleep(2)\nprint('held', flush=True)"
    )
    result = run(code, work_root, MEMORY_64)
    assert "held" not in result.stdout and result.killed_by == "SIGKILL", result


def test_cgroup_parent_that_cannot_serve_is_reported(work_root: str) -> None:
    result = run("print(1)", work_root, PATIENT, cgroup_parent=work_root)  # a folder, not a cgroup
    assert result.ok and "cgroup" not in result.report.applied
    assert any(f"cgroup_parent {work_root}" in m for m in result.report.missing)
    with pytest.raises(SandboxUnavailable, match="cgroup"):
        run("print(1)", work_root, PATIENT, cgroup_parent=work_root, require=("cgroup",))


def test_what_programs_use_still_works_under_the_filter(work_root: str) -> None:
    """The filter is a deny list of what Python programs never call: threads, subprocesses
    (glibc tries clone3 first), a fork-based multiprocessing pool (pipes, POSIX semaphores in
    /dev/shm), asyncio (a socket pair) and temporary files all still work."""
    code = (
        "import asyncio, multiprocessing, subprocess, tempfile, threading\n"
        "out = []\nt = threading.Thread(target=out.append, args=('thread',))\nt.start()\nt.join()\n"
        "out.append(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
        "with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "    out.append(sum(pool.map(abs, [-1, -2, 3])))\n"
        "out.append(asyncio.run(asyncio.sleep(0, 'loop')))\n"
        "with tempfile.TemporaryFile() as f:\n    f.write(b'tmp')\n    f.seek(0)\n"
        "    out.append(f.read().decode())\nprint(out)"
    )
    result = run(code, work_root, PATIENT)
    assert result.ok, result.stderr
    assert result.stdout == "['thread', 'child', 6, 'loop', 'tmp']\n"


def test_cgroup_parent_is_used_only_where_it_gives_children_memory_and_pids(
    tmp_path: Path,
) -> None:
    from megarl.agent.sandbox import cgroup

    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")
    folder, why_not = cgroup.delegated_parent(str(tmp_path))
    assert folder is None and "memory and pids" in why_not and "['cpu', 'memory']" in why_not
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory pids\n")
    assert cgroup.delegated_parent(str(tmp_path)) == (str(tmp_path), "")

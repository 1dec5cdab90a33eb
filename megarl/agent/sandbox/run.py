"""The parent side of the sandbox: start the launcher (``confine.py``, run by path by a fresh
interpreter), feed it the code, collect the output, kill at the limits and clean up (the run's
uid swept, its folder removed). The overview is in :mod:`megarl.agent.sandbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.agent.sandbox import cgroup
from megarl.agent.sandbox.confine import LAYERS, REQUIREMENTS, SandboxReport
from megarl.distributed.processes import process_lives, process_start, processes_of_uid

# ----------------------------------------------------------------------------------------------
# Public types


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. The defaults fit a math/code tool call; the tool YAML's
    ``config`` overrides any of them by name (see ``docs/sandbox.md``).

    ``memory_mb`` and ``cpu_s`` bind each process; ``max_processes`` (processes and threads,
    the program included) bounds how many there are, so the worst case is about
    ``max_processes * memory_mb`` of memory; with a ``cgroup`` layer ``memory_mb`` bounds all
    of them together. ``memory_mb`` also bounds the run's SysV shared memory in all.
    ``max_file_mb`` bounds each file and, with a private root, all of the work folder together
    (an in-memory tmpfs of that size).
    ``max_output_bytes`` caps each of stdout and stderr: a program that prints more is stopped,
    its output cut there and marked truncated.
    """

    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 16_384

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = float if f.name == "timeout_s" else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"sandbox limit {f.name} must be a number, got {value!r}")
            if kind is int and not isinstance(value, int):
                raise ValueError(f"sandbox limit {f.name} must be an integer, got {value!r}")
            if value <= 0:
                raise ValueError(f"sandbox limit {f.name} must be positive, got {value!r}")
        if self.memory_mb < 32:
            raise ValueError(f"memory_mb={self.memory_mb}: an interpreter needs at least 32 MiB")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SandboxLimits:
        """The limits named in ``config`` (other keys are the caller's); the rest default."""
        return cls(**{k: config[k] for k in cls.field_names() if k in config})


@dataclass(frozen=True)
class SandboxResult:
    """How a program ended. ``exit_code`` is ``None`` when it did not exit by itself;
    ``killed_by`` then says why: ``"timeout"``, ``"output_limit"`` or the signal's name
    (``"SIGXCPU"``: CPU limit; ``"SIGKILL"``: hard CPU limit or the kernel). ``stdout`` and
    ``stderr`` are decoded UTF-8 (undecodable bytes replaced), each at most
    ``max_output_bytes`` long; ``truncated`` says whether anything was cut."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    killed_by: str | None
    truncated: bool
    report: SandboxReport = field(repr=False)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's fault)."""


class SandboxUnavailable(SandboxError):
    """A protection named in ``require=`` is not available on this machine."""


# ----------------------------------------------------------------------------------------------
# The parent side: start the launcher, feed the code, collect output, kill, clean up.

# Grace for the launcher's pipes to close after the kill; beyond it the run is abandoned.
_KILL_GRACE_S = 5.0
# How long the uid sweep keeps finding and killing processes before it gives up.
_SWEEP_ROUNDS = 50
# Fresh uids/gids for root runs are drawn from here: far above any distribution's users.
_UID_BASE = 0x6000_0000
_UID_SPAN = 1 << 24
_SYSTEM_READ_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/ld.so.cache")
# A run's folder: its name's prefix, and the file in it naming the trainer that made it.
_FOLDER_PREFIX = "megarl-sandbox-"
_OWNER_FILE = "owner.json"
# The launcher script, run by path (not as a module: it must not import megarl).
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")


async def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    python: str | None = None,
    read_paths: Iterable[str] = (),
    require: Collection[str] = (),
    work_root: str | None = None,
    cgroup_parent: str | None = None,
) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh sandbox; never raises for what the program
    does (it is all in the result), only :class:`SandboxError` when the sandbox cannot start.

    ``python``: the interpreter (default: this one, so the program sees the same installed
    packages, read-only). ``read_paths``: more folders it may read. ``require``: names of
    :data:`REQUIREMENTS` (or layers) that must be applied, else :class:`SandboxUnavailable`.
    ``work_root``: where the temporary folder is made (default: the system's temp dir).
    ``cgroup_parent``: a delegated cgroup v2 folder for the run's cgroup (default: the
    trainer's own cgroup where it can serve; see :mod:`megarl.agent.sandbox.cgroup`).
    """
    limits = limits or SandboxLimits()
    python = python or sys.executable
    if not python:
        raise SandboxError("no Python interpreter to run the code with (sys.executable is empty)")
    unknown = [r for r in require if r not in REQUIREMENTS and r not in LAYERS]
    if unknown:
        raise ValueError(f"unknown sandbox requirements {unknown}; known: {sorted(REQUIREMENTS)}")
    root = os.path.abspath(work_root or tempfile.gettempdir())
    if root not in _SWEPT:
        _SWEPT.add(root)
        await asyncio.to_thread(sweep_leftovers, root)
    run = _Run.create(python, limits, read_paths, require, root, cgroup_parent)
    try:
        return await run.execute(code.encode("utf-8", errors="replace"))
    finally:
        await asyncio.shield(asyncio.to_thread(run.cleanup))


_PROBES: dict[str, SandboxReport] = {}
_SWEPT: set[str] = set()  # work roots swept of dead trainers' folders by this process


def sweep_leftovers(work_root: str) -> list[str]:
    """Remove the run folders in ``work_root`` that a dead trainer left (a SIGKILL gives no
    clean-up), once per process and work root, before its first run. Only folders this code
    made: named ``megarl-sandbox-*``, owned by this user, holding an owner file (written by
    the trainer, not the program) that names a process which no longer runs (pid and start
    time: a recycled pid is another process). Anything else is never touched. Returns the
    removed paths."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(work_root) as entries:
        for entry in entries:
            if entry.name.startswith(_FOLDER_PREFIX) and _left_by_dead_trainer(entry.path):
                _remove_tree(entry.path)
                removed.append(entry.path)
    return removed


def _left_by_dead_trainer(path: str) -> bool:
    try:
        folder = os.lstat(path)
        fd = os.open(os.path.join(path, _OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8") as f:
            owner_uid = os.fstat(f.fileno()).st_uid
            owner = json.loads(f.read(4096))
        pid, start = int(owner["pid"]), int(owner["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    ours = folder.st_uid == owner_uid == os.geteuid() and stat.S_ISDIR(folder.st_mode)
    return ours and process_start(pid) != start


async def probe(python: str | None = None) -> SandboxReport:
    """The protections this machine gives a run (runs an empty program once per interpreter):
    for start-up logs and for skipping tests that need a protection."""
    python = python or sys.executable
    if python not in _PROBES:
        result = await run_python("", SandboxLimits(timeout_s=30), python=python)
        _PROBES[python] = result.report
    return _PROBES[python]


def _interpreter_paths(python: str) -> list[str]:
    """What an interpreter reads: ``bin``, ``lib`` (``lib64``) and ``pyvenv.cfg`` of its
    installation prefix (``bin/..``), of the one it links to (a venv's ``python`` is a symlink)
    and of a venv's base (``pyvenv.cfg``'s ``home``). Not the whole prefix: an interpreter in
    ``~/bin`` must not make the home folder readable."""
    prefixes: list[str] = []
    for exe in (os.path.abspath(python), os.path.realpath(python)):
        prefix = os.path.dirname(os.path.dirname(exe))
        prefixes.append(prefix)
        cfg = os.path.join(prefix, "pyvenv.cfg")
        if os.path.isfile(cfg):
            with open(cfg, encoding="utf-8") as f:
                for line in f:
                    key, _, value = line.partition("=")
                    if key.strip() == "home" and value.strip():
                        prefixes.append(os.path.dirname(value.strip()))
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        prefixes += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    parts = ("bin", "lib", "lib64", "pyvenv.cfg")
    return [os.path.join(prefix, part) for prefix in prefixes for part in parts]


def _read_path_list(python: str, extra: Iterable[str]) -> list[str]:
    """Existing read paths, each once (a symlink with its target), none below another one
    (bound as a whole already)."""
    candidates = [*_SYSTEM_READ_PATHS, *_interpreter_paths(python), *extra]
    unique: list[str] = []
    for path in (os.path.abspath(p) for p in candidates):
        for one in (path, os.path.realpath(path)):
            if os.path.lexists(one) and one not in unique:
                unique.append(one)
    return [
        p for p in unique if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in unique)
    ]


def _minimal_env(python: str, workdir: str) -> dict[str, str]:
    """Everything the program's environment holds: nothing of the trainer's (API keys, tokens,
    cluster addresses). One thread per numeric library: threads count as processes."""
    bin_dir = os.path.dirname(os.path.abspath(python))
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


class _CappedBuffer:
    """Keeps the first ``cap`` bytes of a stream and whether more came."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.overflowed = False

    def add(self, chunk: bytes) -> bool:
        """False once the stream went over the cap."""
        room = self.cap - len(self.data)
        self.data += chunk[: max(room, 0)]
        if len(chunk) > room:
            self.overflowed = True
        return not self.overflowed

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass
class _Run:
    """One program's sandbox on the parent side: its folders, uid and launcher process."""

    limits: SandboxLimits
    base: str
    uid: int | None
    spec: dict[str, Any]
    cgroup: str | None = None
    proc: asyncio.subprocess.Process | None = None
    killed_by: str | None = None

    @classmethod
    def create(
        cls,
        python: str,
        limits: SandboxLimits,
        read_paths: Iterable[str],
        require: Collection[str],
        work_root: str | None,
        cgroup_parent: str | None = None,
    ) -> _Run:
        """Make ``<tmp>/megarl-sandbox-*/{work,root}``: ``work`` is the program's empty cwd,
        ``root`` the mount point of its private root; ``owner.json`` names this trainer (pid
        and start time) for :func:`sweep_leftovers`. The base is 0711 (traversable, not
        listable) so that a fresh uid can reach ``work`` even without a private root."""
        base = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=work_root)
        workdir = os.path.join(base, "work")
        newroot = os.path.join(base, "root")
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if os.geteuid() == 0 else None
        try:
            with open(os.path.join(base, _OWNER_FILE), "x", encoding="utf-8") as f:
                json.dump({"pid": os.getpid(), "start": process_start(os.getpid())}, f)
            os.chmod(base, 0o711)
            os.mkdir(workdir, 0o700)
            os.mkdir(newroot, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
        except OSError:
            _remove_tree(base)
            raise
        cgroup_folder, cgroup_missing = cgroup.create(
            limits.memory_mb, limits.max_processes, cgroup_parent
        )
        spec = {
            "python": os.path.abspath(python),
            "read_paths": _read_path_list(python, read_paths),
            "workdir": workdir,
            "newroot": newroot,
            "uid": uid,
            "limits": dataclasses.asdict(limits),
            "env": _minimal_env(python, workdir),
            "require": list(require),
            "parent_pid": os.getpid(),
            "cgroup": cgroup_folder,
            "cgroup_missing": cgroup_missing,
        }
        return cls(limits=limits, base=base, uid=uid, spec=spec, cgroup=cgroup_folder)

    async def execute(self, code: bytes) -> SandboxResult:
        start = time.monotonic()
        read_fd, write_fd = os.pipe()
        try:
            self.proc = await self._spawn(write_fd)
        except BaseException as e:  # OSError, or cancelled: the control pipe goes either way
            os.close(read_fd)
            if isinstance(e, OSError):
                raise SandboxError(f"cannot start the sandbox launcher: {e}") from e
            raise
        finally:
            os.close(write_fd)
        out = _CappedBuffer(self.limits.max_output_bytes)
        err = _CappedBuffer(self.limits.max_output_bytes)
        control = await self._supervise(code, read_fd, out, err)
        return self._result(control, out, err, time.monotonic() - start)

    async def _spawn(self, control_fd: int) -> asyncio.subprocess.Process:
        """Start the launcher. Cancelled meanwhile, the start still completes (and the process
        is recorded for :meth:`cleanup` to kill) before the cancellation goes on: Python 3.11's
        ``create_subprocess_exec`` cancelled while it connects the pipes waits forever for an
        exit it never learns of (its transport finishes only once every pipe connected), so a
        step whose other trajectory failed would hang in this tool call."""
        starting = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                "-S",
                _LAUNCHER,
                json.dumps({**self.spec, "control_fd": control_fd}),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(control_fd,),
                start_new_session=True,
                env=self.spec["env"],
                cwd=self.base,
            )
        )
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            while not starting.done():  # a start takes milliseconds: cancellations wait for it
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({starting})
            if not starting.cancelled() and starting.exception() is None:
                self.proc = starting.result()
            raise

    async def _supervise(
        self, code: bytes, control_fd: int, out: _CappedBuffer, err: _CappedBuffer
    ) -> bytes:
        """Feed the code and read everything until the launcher is gone, killing it at the
        timeout or when the output goes over the cap. Returns the control channel's bytes."""
        proc = self.proc
        assert proc is not None and proc.stdin and proc.stdout and proc.stderr
        control = bytearray()
        tasks = [
            asyncio.ensure_future(self._feed(proc.stdin, code)),
            asyncio.ensure_future(self._pump(proc.stdout, out)),
            asyncio.ensure_future(self._pump(proc.stderr, err)),
            asyncio.ensure_future(_read_fd(control_fd, control)),
            asyncio.ensure_future(proc.wait()),
        ]
        try:
            _, pending = await asyncio.wait(tasks, timeout=self.limits.timeout_s)
            if pending:
                self.kill("timeout")
                _, pending = await asyncio.wait(pending, timeout=_KILL_GRACE_S)
            if pending:  # the launcher did not end the run (or a process escaped it)
                await asyncio.to_thread(self.kill_hard)
                _, pending = await asyncio.wait(pending, timeout=_KILL_GRACE_S)
        finally:
            for task in tasks:
                task.cancel()
            self.kill(None)
            _close_pipes(proc)
        return bytes(control)

    @staticmethod
    async def _feed(stdin: asyncio.StreamWriter, code: bytes) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(code)
            await stdin.drain()
        stdin.close()

    async def _pump(self, stream: asyncio.StreamReader, buf: _CappedBuffer) -> None:
        """Keep the stream's first bytes; past the cap, stop the run and read on to EOF,
        discarding: a reader that stops pauses its pipe with data in it, its EOF is never
        seen, and Python 3.11's ``Process.wait()`` waits for EOF on every pipe (the call would
        last until the timeout plus grace, the pipe left open in the trainer)."""
        while chunk := await stream.read(1 << 16):
            if not buf.add(chunk) and self.killed_by is None:
                self.kill("output_limit")

    def kill(self, reason: str | None) -> None:
        """Ask the launcher to end the run (SIGTERM): it SIGKILLs init, whose death takes the
        PID namespace and everything in it along, kills what else is left below it, reaps it
        all and exits. ``reason`` is recorded once."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if reason and self.killed_by is None:
            self.killed_by = reason
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)

    def kill_hard(self) -> None:
        """Blocking: SIGKILL the launcher's process group and every process of the run's uid
        (for when the launcher cannot do its job, and processes that left the group)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.uid is not None:
            _sweep_uid(self.uid, rounds=_SWEEP_ROUNDS)

    def _result(
        self, control: bytes, out: _CappedBuffer, err: _CappedBuffer, duration: float
    ) -> SandboxResult:
        messages = [json.loads(line) for line in control.decode().splitlines() if line.strip()]
        by_kind = {key: m[key] for m in messages for key in m}
        if "error" in by_kind:
            report = by_kind.get("report")
            exc = SandboxUnavailable if by_kind.get("unavailable") else SandboxError
            raise exc(by_kind["error"] + (f" (applied: {report['applied']})" if report else ""))
        if "report" not in by_kind:
            if self.killed_by == "timeout":
                raise SandboxError(f"the sandbox did not start within {self.limits.timeout_s} s")
            detail = err.text().strip()[-2000:] or f"launcher exit status {self.proc_status()}"
            raise SandboxError(f"the sandbox did not start: {detail}")
        exit_info = by_kind.get("exit", {})
        exit_code = exit_info.get("code") if self.killed_by is None else None
        killed_by = self.killed_by or exit_info.get("signal")
        if exit_code is None and killed_by is None:
            killed_by = "SIGKILL"  # the launcher died before reporting: the kernel killed it
        return SandboxResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=exit_code,
            timed_out=self.killed_by == "timeout",
            killed_by=killed_by,
            truncated=out.overflowed or err.overflowed,
            report=SandboxReport.from_json(by_kind["report"]),
            duration_s=duration,
        )

    def proc_status(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def cleanup(self) -> None:
        """Blocking (run in a thread, also when the caller was cancelled): make sure no process
        of the run is left, then remove its cgroup and folder."""
        if self.proc is not None and self.proc.returncode is None:
            self.kill(None)
            _wait_gone(self.proc.pid, _KILL_GRACE_S)
        self.kill_hard()
        if self.cgroup is not None:
            cgroup.remove(self.cgroup)
        _remove_tree(self.base)


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` has exited (gone, or a zombie its parent has yet to reap)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_lives(pid):
        time.sleep(0.01)


def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close the launcher's pipes in the trainer: a no-op when each reached EOF, as each does
    unless the run was abandoned. No fd of a run outlives its call."""
    transport = getattr(proc, "_transport", None)  # asyncio has no public handle on the pipes
    if transport is None:
        return
    for fd in (0, 1, 2):
        pipe = transport.get_pipe_transport(fd)
        if pipe is not None and not pipe.is_closing():
            pipe.close()


async def _read_fd(fd: int, into: bytearray) -> None:
    """Read a pipe's read end until EOF without blocking the loop (owns and closes ``fd``)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        while chunk := await reader.read(1 << 16):
            into += chunk
    finally:
        transport.close()


def _sweep_uid(uid: int, rounds: int) -> None:
    """SIGKILL every process of the run's private uid until none is left (a fork bomb without
    a PID namespace may fork between the listing and the kill: hence rounds)."""
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _remove_tree(path: str) -> None:
    """Remove the run's folder, also where the program took away its own permissions on parts
    of it (unprivileged runs: root ignores modes)."""
    for _ in range(3):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            with contextlib.suppress(OSError):
                os.chmod(path, stat.S_IRWXU)
            for root, dirs, _files in os.walk(path):  # top-down: fixed before it is entered
                for name in dirs:
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(root, name), stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)

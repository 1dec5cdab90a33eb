"""The launcher and init of the sandbox: a fresh interpreter runs this file by path (stdlib
only, single-threaded; it never imports megarl) to confine and run one program. The overview of
the layers is in :mod:`megarl.agent.sandbox`; the parent side is
:mod:`megarl.agent.sandbox.run`, which imports the definitions both sides share from here
(:data:`REQUIREMENTS`, :class:`SandboxReport`, the layer names).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any


def _load_sibling(name: str) -> ModuleType:
    """A stdlib-only module of this package (``seccomp``, ``landlock``): imported as part of
    the package on the parent side; loaded by path in the launcher, which runs this file as a
    script (``-I -S``: megarl is not importable)."""
    import importlib
    import importlib.util

    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_megarl_sandbox_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# Shared with the parent side

# The summary names ``require=`` accepts, each satisfied by any one of the layers listed.
REQUIREMENTS: Mapping[str, tuple[str, ...]] = {
    "network": ("net-namespace",),
    "filesystem": ("private-root", "landlock-fs"),
    "processes": ("pid-namespace", "private-uid"),
    "syscalls": ("seccomp",),
}


@dataclass(frozen=True)
class SandboxReport:
    """Which protections a run actually had, as measured by the init that applied them.

    ``applied`` holds layer names (``net-namespace``, ``pid-namespace``, ``mount-namespace``,
    ``private-root``, ``ipc-namespace``, ``uts-namespace``, ``user-namespace``,
    ``private-uid``, ``landlock-fs``, ``landlock-net``, ``landlock-scope``, ``no-new-privs``,
    ``rlimits``, ``rlimit-nproc``, ``clean-env``, ``isolated-python``, ``new-session``,
    ``session-keyring``, ``ipc-limits``, ``cgroup``, ``seccomp``);
    ``missing`` says, in words, what was not applied and why. Nothing is claimed that the
    kernel did not accept.
    """

    applied: tuple[str, ...]
    missing: tuple[str, ...] = ()
    uid: int | None = None
    landlock_abi: int = 0

    @property
    def network_isolated(self) -> bool:
        """No network at all (a network namespace). Landlock alone blocks TCP only."""
        return self.satisfies("network")

    @property
    def filesystem_confined(self) -> bool:
        """Files outside the temporary folder and the installations cannot be read or written."""
        return self.satisfies("filesystem")

    @property
    def processes_contained(self) -> bool:
        """Every process the program starts is killed at the end, also one that ``setsid()``-s."""
        return self.satisfies("processes")

    def satisfies(self, requirement: str) -> bool:
        """``requirement``: a summary name of :data:`REQUIREMENTS` or a layer name."""
        layers = REQUIREMENTS.get(requirement, (requirement,))
        return any(layer in self.applied for layer in layers)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxReport:
        return cls(
            applied=tuple(data["applied"]),
            missing=tuple(data["missing"]),
            uid=data.get("uid"),
            landlock_abi=int(data.get("landlock_abi", 0)),
        )


# Every layer name a report can hold; ``require=`` accepts these as well as REQUIREMENTS' keys.
LAYERS = (
    "new-session",
    "clean-env",
    "isolated-python",
    "user-namespace",
    "net-namespace",
    "pid-namespace",
    "mount-namespace",
    "ipc-namespace",
    "uts-namespace",
    "private-root",
    "private-uid",
    "no-new-privs",
    "landlock-fs",
    "landlock-net",
    "landlock-scope",
    "rlimits",
    "rlimit-nproc",
    "session-keyring",
    "ipc-limits",
    "cgroup",
    "seccomp",
)

# The device files the program gets (bound into a private root, allowed by Landlock).
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

# ----------------------------------------------------------------------------------------------
# The launcher and init: a fresh interpreter running this file (stdlib only, single-threaded).

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_NAMESPACES = {
    _CLONE_NEWNET: "net-namespace",
    _CLONE_NEWPID: "pid-namespace",
    _CLONE_NEWNS: "mount-namespace",
    _CLONE_NEWIPC: "ipc-namespace",
    _CLONE_NEWUTS: "uts-namespace",
}

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_MOVE = 8192
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36

# keyctl(2): its number by architecture (glibc has no wrapper), and the operation used.
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_JOIN_SESSION_KEYRING = 1

# SysV IPC limits of the run's IPC namespace: segments and message queues hold memory that no
# process maps (attach, fill, detach, repeat), which RLIMIT_AS does not count.
_IPC_SYSCTLS = ("shmmax", "shmall", "shmmni", "msgmni")
_SHM_SEGMENTS = 64
_MSG_QUEUES = 16


class _Layers:
    """What the launcher and init applied and what they could not, for the report."""

    def __init__(self) -> None:
        self.applied = ["new-session", "clean-env", "isolated-python"]
        self.missing: list[str] = []
        self.uid: int | None = None
        self.landlock_abi = 0

    def add(self, name: str) -> None:
        self.applied.append(name)

    def lack(self, what: str) -> None:
        self.missing.append(what)

    def as_json(self) -> dict[str, Any]:
        return {
            "applied": self.applied,
            "missing": self.missing,
            "uid": self.uid,
            "landlock_abi": self.landlock_abi,
        }


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mount.argtypes = (
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    )
    return libc


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount(
    libc: ctypes.CDLL,
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _send(fd: int, message: Mapping[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


class _Stop(Exception):
    """Raised by the launcher's SIGTERM handler: the parent asks it to end the run."""


def _launcher_main(argv: list[str]) -> int:
    """The launcher: enter namespaces, fork init, wait for it, then kill and reap every process
    left below it. It runs as the trainer's user (root: with all capabilities) and never runs
    model code. SIGTERM (the parent's timeout) ends the run the same way, so that every process
    is reaped here and none becomes a zombie of the machine's init."""
    spec = json.loads(argv[0])
    control = spec["control_fd"]
    os.set_inheritable(control, False)  # the program's exec closes it
    libc = _libc()
    # The trainer dying must not leave a sandbox behind; our parent may already be gone.
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != spec["parent_pid"]:
        return 1
    # Orphans below us (a daemon that left init, without a PID namespace) come to us.
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _raise_stop)
    layers = _Layers()
    flags = _enter_namespaces(libc, layers)
    pid = os.fork()
    if pid == 0:
        try:
            _init_main(spec, libc, layers, flags)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the parent, then exit
            with contextlib.suppress(OSError):
                _send(control, {"error": f"sandbox setup failed: {e!r}"})
        os._exit(125)
    os.close(control)
    for fd in (0, 1, 2):  # the launcher holds no end of the program's pipes
        os.close(fd)
    with contextlib.suppress(_Stop):
        os.waitpid(pid, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_descendants(pid)
    return 0


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop


def _kill_descendants(init_pid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL init and every child we have (orphans come to us as subreaper) and reap them,
    until we have no child left. Killing our own unreaped children cannot hit a reused pid."""
    children_file = f"/proc/self/task/{os.getpid()}/children"
    deadline = time.monotonic() + timeout_s
    # Init's process group first: one atomic kill of every process that kept it (a fork bomb
    # cannot outrun it), then the ones that left it, as they come to us.
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(init_pid, signal.SIGKILL)
    while time.monotonic() < deadline:
        try:
            with open(children_file) as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child left
        time.sleep(0.005)


def _enter_namespaces(libc: ctypes.CDLL, layers: _Layers) -> int:
    """Root: unshare net, PID, mount, IPC, UTS (each alone if the set fails). Not root: the
    same inside a new user namespace mapping only our own uid, if the kernel allows one."""
    wanted = _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS
    entered = 0
    if os.geteuid() == 0:
        if libc.unshare(wanted) == 0:
            entered = wanted
        else:
            for flag in _NAMESPACES:
                if libc.unshare(flag) == 0:
                    entered |= flag
    else:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(_CLONE_NEWUSER | wanted) == 0:
            entered = wanted
            layers.add("user-namespace")
            for path, text in (
                ("/proc/self/setgroups", "deny"),
                ("/proc/self/uid_map", f"{uid} {uid} 1"),
                ("/proc/self/gid_map", f"{gid} {gid} 1"),
            ):
                with open(path, "w") as f:
                    f.write(text)
        else:
            err = os.strerror(ctypes.get_errno())
            layers.lack(f"namespaces: not root and no user namespace ({err})")
    for flag, name in _NAMESPACES.items():
        if entered & flag:
            layers.add(name)
        elif os.geteuid() == 0:
            layers.lack(f"{name}: unshare refused ({os.strerror(ctypes.get_errno())})")
    return entered


def _init_main(spec: dict[str, Any], libc: ctypes.CDLL, layers: _Layers, flags: int) -> None:
    """Init (PID 1 of the new PID namespace): confine itself (root, files, Landlock, uid),
    report, fork the program and wait for it. When init exits, the kernel kills every process
    left in its PID namespace."""
    control = spec["control_fd"]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a program signalling init must not end the run
    os.setpgid(0, 0)  # a group of its own, which the program inherits: killed at once
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # the launcher gone: so are we
    workdir = spec["workdir"]
    # Now: the private root does not hold these files.
    seccomp, landlock = _load_sibling("seccomp"), _load_sibling("landlock")
    _join_session_keyring(libc, layers)
    _join_cgroup(spec, layers)
    if flags & _CLONE_NEWIPC:
        _limit_ipc(spec, layers)
    else:
        layers.lack("ipc-limits: no IPC namespace; the host's SysV limits apply")
    private_root = False
    if flags & _CLONE_NEWNS:
        _build_private_root(libc, spec)
        private_root = True
        layers.add("private-root")
    else:
        layers.lack(
            "private-root: no mount namespace; the host's file tree is visible (Landlock or "
            "file permissions decide), UNIX sockets with open permissions are reachable"
        )
    os.chdir(workdir)
    _apply_landlock(libc, landlock, spec, layers, private_root)
    _drop_uid(spec, layers, private_root)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    layers.add("no-new-privs")
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program, even with init's uid, cannot ptrace it
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # a uid change cleared it
    limits = _rlimits(spec, layers)
    # Last: init's own set-up above needed mount, unshare, keyctl... that the filter refuses.
    _install_seccomp(libc, seccomp, layers)
    report = SandboxReport.from_json(layers.as_json())
    _send(control, {"report": layers.as_json()})
    missing = [r for r in spec["require"] if not report.satisfies(r)]
    if missing:
        error = f"required sandbox protections missing: {missing}; {list(report.missing)}"
        _send(control, {"error": error, "unavailable": True})
        os._exit(125)
    pid = os.fork()
    if pid == 0:
        _exec_program(spec, limits, control)
    for fd in (0, 1, 2):
        os.close(fd)
    _send(control, {"exit": _wait_program(pid)})
    os._exit(0)


def _join_session_keyring(libc: ctypes.CDLL, layers: _Layers) -> None:
    """A new anonymous session keyring, owned by init's (not the program's) uid: the kernel's
    keyrings are not namespaced, and the one inherited from the trainer (a PAM login's, a
    systemd service's) may hold its keys. Freed when the run's last process is gone."""
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        layers.lack(f"session-keyring: no keyctl number known for {os.uname().machine}")
        return
    if libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        layers.lack(f"session-keyring: keyctl refused ({os.strerror(ctypes.get_errno())})")
        return
    layers.add("session-keyring")


def _join_cgroup(spec: dict[str, Any], layers: _Layers) -> None:
    """Move init (and so every process it starts) into the run's cgroup, which the parent made
    with the run's limits (:mod:`megarl.agent.sandbox.cgroup`)."""
    folder = spec.get("cgroup")
    if folder is None:
        layers.lack(f"cgroup: {spec.get('cgroup_missing') or 'none made'}")
        return
    try:
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write("0")  # the writer itself
    except OSError as e:
        layers.lack(f"cgroup: cannot join {folder} ({e.strerror})")
        return
    layers.add("cgroup")


def _limit_ipc(spec: dict[str, Any], layers: _Layers) -> None:
    """The run's IPC namespace gets SysV limits from ``memory_mb``: all shared-memory segments
    together at most ``memory_mb`` (``shmall``; ``shmmax`` per segment), at most
    ``_SHM_SEGMENTS`` segments and ``_MSG_QUEUES`` message queues (16 KiB each by default).
    Written through the host's /proc before the private root hides it: these sysctls are
    per IPC namespace, the writer's."""
    memory = spec["limits"]["memory_mb"] << 20
    values = {
        "shmmax": memory,
        "shmall": memory // os.sysconf("SC_PAGE_SIZE"),
        "shmmni": _SHM_SEGMENTS,
        "msgmni": _MSG_QUEUES,
    }
    try:
        for name in _IPC_SYSCTLS:
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(values[name]))
    except OSError as e:
        layers.lack(f"ipc-limits: cannot set kernel.{name} in the IPC namespace ({e.strerror})")
        return
    layers.add("ipc-limits")


def _install_seccomp(libc: ctypes.CDLL, seccomp: ModuleType, layers: _Layers) -> None:
    """The system-call filter (:mod:`megarl.agent.sandbox.seccomp`) on init, which the program
    inherits across fork and exec. Needs ``no_new_privs`` (set before)."""
    why_not = seccomp.supported()
    if why_not is not None:
        layers.lack(f"seccomp: {why_not}")
        return
    # Without limits of its own, the IPC namespace's SysV memory is bounded by nothing small.
    also_refused = seccomp.SYSV_IPC if "ipc-limits" not in layers.applied else {}
    try:
        seccomp.install(libc, seccomp.program(also_refused))
    except OSError as e:
        layers.lack(f"seccomp: the kernel refused the filter ({e.strerror})")
        return
    layers.add("seccomp")


def _build_private_root(libc: ctypes.CDLL, spec: dict[str, Any]) -> None:
    """A root of its own: a read-only tmpfs holding read-only binds of the system and Python
    folders at their usual paths, four device files, and two small tmpfs of ``max_file_mb``
    each: the work folder (at its usual path, owned by the program's uid) and /dev/shm; then
    chroot into it. Nothing else of the host exists for the program, and what it writes is in
    memory, bounded, never on the host's disk."""
    newroot = spec["newroot"]
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
    _mount(libc, "tmpfs", newroot, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for path in spec["read_paths"]:
        _bind(libc, path, newroot, read_only=True)
    for dev in _DEVICES:
        if os.path.exists(dev):
            _bind(libc, dev, newroot, read_only=False, nodev=False)
    size = f"size={spec['limits']['max_file_mb']}m,nr_inodes=16k"
    owner = spec["uid"] if spec["uid"] is not None else os.getuid()
    work = newroot + spec["workdir"]
    os.makedirs(work, exist_ok=True)
    tmpfs_flags = _MS_NOSUID | _MS_NODEV
    _mount(libc, "tmpfs", work, "tmpfs", tmpfs_flags, f"{size},mode=0700,uid={owner},gid={owner}")
    shm = newroot + "/dev/shm"
    os.makedirs(shm, exist_ok=True)
    _mount(libc, "tmpfs", shm, "tmpfs", tmpfs_flags | _MS_NOEXEC, f"{size},mode=1777")
    _mount(libc, None, newroot, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(newroot)
    _mount(libc, newroot, "/", None, _MS_MOVE)
    os.chroot(".")


def _bind(
    libc: ctypes.CDLL, path: str, newroot: str, *, read_only: bool, nodev: bool = True
) -> None:
    """Bind ``path`` to the same path under ``newroot`` (a symlink is copied as a symlink;
    its target is bound on its own). The remount keeps the flags an unprivileged mount
    namespace may not drop (nosuid, noexec...) and adds read-only/nosuid/nodev."""
    target = newroot + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()  # a file mount point
    _mount(libc, path, target, None, _MS_BIND | _MS_REC)
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _locked_flags(path)
    flags |= (_MS_RDONLY if read_only else 0) | (_MS_NODEV if nodev else 0)
    _mount(libc, None, target, None, flags)


def _locked_flags(path: str) -> int:
    """The mount flags of ``path``'s mount that a remount must repeat (``statvfs`` view)."""
    f_flag = os.statvfs(path).f_flag
    pairs = (
        (os.ST_RDONLY, _MS_RDONLY),
        (os.ST_NOSUID, _MS_NOSUID),
        (os.ST_NODEV, _MS_NODEV),
        (os.ST_NOEXEC, _MS_NOEXEC),
        (os.ST_NOATIME, _MS_NOATIME),
        (os.ST_NODIRATIME, _MS_NODIRATIME),
        (os.ST_RELATIME, _MS_RELATIME),
    )
    return sum(ms for st, ms in pairs if f_flag & st)


def _apply_landlock(
    libc: ctypes.CDLL,
    landlock: ModuleType,
    spec: dict[str, Any],
    layers: _Layers,
    private_root: bool,
) -> None:
    """Landlock (:mod:`megarl.agent.sandbox.landlock`): read/execute of the read paths,
    read-write of the work folder (and the private /dev/shm), the device files; with ABI >= 4
    no TCP bind/connect, with ABI >= 6 no signals or abstract UNIX sockets leaving the sandbox.
    Needs no privilege."""
    abi = landlock.abi(libc)
    if abi < 1:
        layers.lack(f"landlock: not supported by this kernel ({os.strerror(ctypes.get_errno())})")
        return
    layers.landlock_abi = abi
    writable = [spec["workdir"]]
    if private_root:  # the host's /dev/shm holds the trainer's shared memory: never that
        writable.append("/dev/shm")
    landlock.restrict(libc, abi, read_paths=spec["read_paths"], devices=_DEVICES, writable=writable)
    layers.add("landlock-fs")
    if abi >= landlock.NET_ABI:
        layers.add("landlock-net")
    else:
        layers.lack(f"landlock-net: Landlock ABI {abi} < 4 cannot block TCP")
    if abi >= landlock.SCOPE_ABI:
        layers.add("landlock-scope")
    else:
        layers.lack(f"landlock-scope: Landlock ABI {abi} < 6 cannot scope signals/sockets")


def _drop_uid(spec: dict[str, Any], layers: _Layers, private_root: bool) -> None:
    """Root: become the run's fresh uid/gid with no supplementary groups (no capability is
    left). Without a private root the interpreter must then be reachable by others, else the
    run is refused: model code never runs as root."""
    uid = spec["uid"]
    if uid is None:
        layers.lack("private-uid: not root; the program runs as the trainer's user")
        return
    if not private_root and not _reachable_by_others(spec["python"]):
        raise PermissionError(
            f"{spec['python']} is not readable by an unprivileged uid and no mount namespace "
            "is available to fix that; use an interpreter others can read (python: ...)"
        )
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    layers.uid = uid
    layers.add("private-uid")


def _reachable_by_others(path: str) -> bool:
    """Every folder up to ``path`` searchable, and the file readable+executable, by others."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    return os.stat(path).st_mode & (stat.S_IROTH | stat.S_IXOTH) == (stat.S_IROTH | stat.S_IXOTH)


def _rlimits(spec: dict[str, Any], layers: _Layers) -> list[tuple[int, int]]:
    """The limits the program gets (set by the program's process right before exec).
    ``RLIMIT_NPROC`` counts processes of a uid (per user namespace): only meaningful with a
    private uid or in our own user namespace, where init (and the launcher) count too."""
    lim = spec["limits"]
    mib = 1 << 20
    limits = [
        (resource.RLIMIT_CPU, lim["cpu_s"]),
        (resource.RLIMIT_AS, lim["memory_mb"] * mib),
        (resource.RLIMIT_FSIZE, lim["max_file_mb"] * mib),
        (resource.RLIMIT_NOFILE, lim["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    layers.add("rlimits")
    if layers.uid is not None:
        limits.append((resource.RLIMIT_NPROC, lim["max_processes"] + 1))
        layers.add("rlimit-nproc")
    elif "user-namespace" in layers.applied:
        limits.append((resource.RLIMIT_NPROC, lim["max_processes"] + 2))
        layers.add("rlimit-nproc")
    else:
        layers.lack("rlimit-nproc: it would count all of the trainer user's processes")
    return limits


def _exec_program(spec: dict[str, Any], limits: list[tuple[int, int]], control: int) -> None:
    """The program's process: default signal handling, the limits, then the interpreter
    (``-I``: no environment variables, no user site, no script folder on ``sys.path``; ``-B``:
    no bytecode files; ``-u``: output survives a kill). Never returns."""
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        for which, value in limits:
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        python = spec["python"]
        os.execve(python, [python, "-I", "-B", "-u", "-"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - report why the program could not start
        with contextlib.suppress(OSError):
            _send(control, {"error": f"cannot start {spec['python']}: {e!r}"})
    os._exit(127)


def _wait_program(pid: int) -> dict[str, Any]:
    """Reap children (orphans come to init) until the program ends; its exit status."""
    while True:
        try:
            child, status = os.wait()
        except ChildProcessError:
            return {"code": None, "signal": "SIGKILL"}
        if child == pid:
            if os.WIFSIGNALED(status):
                return {"code": None, "signal": signal.Signals(os.WTERMSIG(status)).name}
            return {"code": os.waitstatus_to_exitcode(status), "signal": None}


if __name__ == "__main__":
    sys.exit(_launcher_main(sys.argv[1:]))

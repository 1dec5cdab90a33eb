"""Landlock, the sandbox's unprivileged file and network confinement, in one place.

Landlock is the one layer that needs no privilege and no namespace: it is what confines files
(and, from ABI 4, TCP) when the trainer is neither root nor allowed a user namespace. Its
syscall numbers, access-right bits by ABI version and ruleset structures are a small kernel
interface of their own, kept here apart from the launcher's namespaces, mounts and limits
(:mod:`megarl.agent.sandbox.confine`), which decides *whether* to apply it and records what was
applied in the run's report.

Stdlib only: the launcher (``confine.py``, run by path with ``-I -S``) loads this file by path,
as it does :mod:`megarl.agent.sandbox.seccomp`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

# Syscall numbers (>= 424: the same on every architecture) and access rights by ABI.
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_LL_EXECUTE = 1 << 0
_LL_WRITE_FILE = 1 << 1
_LL_READ_FILE = 1 << 2
_LL_READ_DIR = 1 << 3
_LL_ABI1_ALL = (1 << 13) - 1  # execute, write/read file, read dir, remove/make anything
_LL_REFER = 1 << 13
_LL_TRUNCATE = 1 << 14
_LL_IOCTL_DEV = 1 << 15
_LL_FILE_RIGHTS = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV
_LL_BIND_TCP = 1 << 0
_LL_CONNECT_TCP = 1 << 1
_LL_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
_LL_SCOPE_SIGNAL = 1 << 1

# landlock_restrict_self needs no_new_privs (or CAP_SYS_ADMIN) in the calling thread.
_PR_SET_NO_NEW_PRIVS = 38

NET_ABI = 4
"""The first ABI that can refuse TCP bind/connect."""
SCOPE_ABI = 6
"""The first ABI that can scope signals and abstract UNIX sockets to the sandbox."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (
        ("allowed_access", ctypes.c_uint64),
        ("parent_fd", ctypes.c_int32),
    )


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def abi(libc: ctypes.CDLL) -> int:
    """The kernel's Landlock ABI version; 0 when it has none (errno says why)."""
    version = libc.syscall(
        _SYS_LANDLOCK_CREATE_RULESET,
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(int(version), 0)


def restrict(
    libc: ctypes.CDLL,
    abi: int,
    *,
    read_paths: Sequence[str],
    devices: Sequence[str],
    writable: Sequence[str],
) -> None:
    """Restrict the calling process (and all it starts) to read/execute of ``read_paths``,
    read-write of ``devices`` and everything in ``writable``; with ABI >= 4 no TCP
    bind/connect, with ABI >= 6 no signals or abstract UNIX sockets leaving it. Sets
    ``no_new_privs``. ``abi`` >= 1, as :func:`abi` returned it. Raises :class:`OSError` when
    the kernel refuses a step."""
    handled = _LL_ABI1_ALL
    handled |= _LL_REFER if abi >= 2 else 0
    handled |= _LL_TRUNCATE if abi >= 3 else 0
    handled |= _LL_IOCTL_DEV if abi >= 5 else 0
    net = _LL_BIND_TCP | _LL_CONNECT_TCP if abi >= NET_ABI else 0  # no rule: none allowed
    scoped = _LL_SCOPE_ABSTRACT_UNIX_SOCKET | _LL_SCOPE_SIGNAL if abi >= SCOPE_ABI else 0
    attr = _RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _check(
        libc.syscall(
            _SYS_LANDLOCK_CREATE_RULESET,
            ctypes.byref(attr),
            ctypes.c_size_t(size),
            ctypes.c_uint32(0),
        ),
        "landlock_create_ruleset",
    )
    try:
        read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
        rules = [(p, read) for p in read_paths]
        rules += [(p, _LL_READ_FILE | _LL_WRITE_FILE | _LL_IOCTL_DEV) for p in devices]
        rules += [(p, handled) for p in writable]
        for path, access in rules:
            _allow(libc, ruleset, path, access & handled)
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(
            libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, access: int) -> None:
    if not os.path.exists(path):
        return
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not os.path.isdir(path):
            access &= _LL_FILE_RIGHTS
        rule = _PathBeneathAttr(access, fd)
        _check(
            libc.syscall(
                _SYS_LANDLOCK_ADD_RULE,
                ruleset,
                _LANDLOCK_RULE_PATH_BENEATH,
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            ),
            f"landlock_add_rule {path}",
        )
    finally:
        os.close(fd)

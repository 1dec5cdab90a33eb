"""The sandbox's system-call filter: what a Python program never needs, refused by the kernel.

Namespaces, Landlock and a private uid decide what a program may *reach*; the kernel's own
interfaces stay callable: keyrings (not namespaced: the trainer's session keyring, and keys
that outlive the program), new user namespaces (a full capability set inside one: the usual
first step of kernel exploits), mounts, ``ptrace``, ``bpf``, ``perf_event_open``,
``userfaultfd``, ``io_uring``, modules, ``kexec``, memfds (memory no address-space limit
counts) and socket address families the network namespace does not isolate (``AF_VSOCK``
reaches the hypervisor on a VM; ``AF_NETLINK``, ``AF_PACKET``, ``AF_ALG`` are kernel surface).

The filter is a classic BPF program for ``seccomp(SECCOMP_SET_MODE_FILTER)``, assembled here
(no libseccomp, no new dependency). It is a deny list: every other call is allowed, so the
interpreter and the packages it imports run unchanged. Refused calls fail with an errno the
program can read (``EPERM``; ``EAFNOSUPPORT`` for a socket family; ``ENOSYS`` for ``clone3``,
whose flags live in memory a filter cannot read: glibc then falls back to ``clone``, whose
flags it can). Anything but the x86-64 system call ABI (i386 ``int 0x80``, x32) kills the
process: the numbers below are x86-64's, and a filter that checked the wrong table would
refuse nothing. On other architectures no filter is built and the layer is reported missing.

Socket families: ``AF_INET``/``AF_INET6`` are allowed (the network namespace has only a
loopback that is down); ``AF_UNIX`` only as a connected pair (``socketpair``, stream or
seqpacket: asyncio's self-pipe, ``multiprocessing.Pipe``). A ``socket(AF_UNIX)`` that could
``connect`` to a socket file (a service's, under a read path: a read-only mount does not stop
``connect``, and Landlock up to ABI 7 cannot) is refused. So are ``multiprocessing``'s
``forkserver`` start method and its managers, which listen on socket files; ``fork`` works.

Stdlib only: the launcher (``confine.py``, run by path with ``-I -S``) loads this file by path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Mapping, Sequence

# Refused with EPERM: x86-64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl).
REFUSED: Mapping[str, int] = {
    # keyrings: not namespaced, and keys outlive the program
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    # namespaces and mounts (unshare/clone are checked by flags below)
    "setns": 308,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "open_tree_attr": 467,
    # other processes' memory
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "pidfd_getfd": 438,
    # kernel programs, events and asynchronous interfaces
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "fanotify_init": 300,
    # modules, kexec and the machine's own state
    "create_module": 174,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "reboot": 169,
    "swapon": 167,
    "swapoff": 168,
    "acct": 163,
    "syslog": 103,
    "quotactl": 179,
    "quotactl_fd": 443,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "vhangup": 153,
    "uselib": 134,
    "lookup_dcookie": 212,
    "nfsservctl": 180,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    # memory outside the address space (RLIMIT_AS): a memfd written but never mapped
    "memfd_create": 319,
    "memfd_secret": 447,
}
# Refused where the run's IPC namespace has no limits of its own (``ipc-limits`` missing: an
# unprivileged run), else their segments and queues hold memory up to the kernel's defaults.
# CPython's stdlib never calls them (``multiprocessing.shared_memory`` is POSIX shm: files).
SYSV_IPC: Mapping[str, int] = {"shmget": 29, "msgget": 68}
_CLONE = 56
_UNSHARE = 272
_CLONE3 = 435
_SOCKET = 41
_SOCKETPAIR = 53

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000
NAMESPACE_FLAGS |= 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
ALLOWED_FAMILIES = (2, 10)  # AF_INET, AF_INET6 (socket())
_AF_UNIX = 1
_PAIR_TYPES = (1, 5)  # SOCK_STREAM, SOCK_SEQPACKET (socketpair(AF_UNIX))
_SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC

AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20
_JEQ_K = 0x05 | 0x10
_JGE_K = 0x05 | 0x30
_JSET_K = 0x05 | 0x40
_AND_K = 0x04 | 0x50
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little endian:
# an argument's low 32 bits come first; the calls checked here take ints)
_NR, _ARCH = 0, 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index


_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

Instruction = tuple[int | str, int | str, int | str, int]


def supported(machine: str | None = None) -> str | None:
    """None when a filter can be built for this process, else why not."""
    machine = machine or os.uname().machine
    if machine != "x86_64" or ctypes.sizeof(ctypes.c_void_p) != 8:
        bits = 8 * ctypes.sizeof(ctypes.c_void_p)
        return f"the filter knows x86-64's system call numbers only; this is {machine} ({bits}-bit)"
    return None


def program(also_refused: Mapping[str, int] | None = None) -> bytes:
    """The filter as ``struct sock_filter[]`` bytes; ``also_refused``: more calls (name ->
    x86-64 number) answered ``EPERM``, e.g. :data:`SYSV_IPC`."""
    return assemble(_instructions({**REFUSED, **(also_refused or {})}))


def _instructions(refused: Mapping[str, int]) -> list[Instruction]:
    """The filter in order; jump targets are labels (``str``) resolved by :func:`assemble`."""
    code: list[Instruction] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 0, "kill", AUDIT_ARCH_X86_64),
        (_LD_W_ABS, 0, 0, _NR),
        (_JGE_K, "enosys", 0, _X32_SYSCALL_BIT),
    ]
    code += [(_JEQ_K, "eperm", 0, nr) for nr in refused.values()]
    code += [
        (_JEQ_K, "enosys", 0, _CLONE3),
        (_JEQ_K, "namespaces", 0, _UNSHARE),
        (_JEQ_K, "namespaces", 0, _CLONE),
        (_JEQ_K, "socket", 0, _SOCKET),
        (_JEQ_K, "socketpair", 0, _SOCKETPAIR),
        (_RET_K, 0, 0, _RET_ALLOW),
        ("namespaces", 0, 0, 0),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JSET_K, "eperm", "allow", NAMESPACE_FLAGS),
        ("socket", 0, 0, 0),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
    ]
    code += [(_JEQ_K, "allow", 0, family) for family in ALLOWED_FAMILIES]
    code += [
        (_JEQ_K, "eafnosupport", "eafnosupport", 0),
        ("socketpair", 0, 0, 0),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JEQ_K, 0, "eafnosupport", _AF_UNIX),
        (_LD_W_ABS, 0, 0, _arg_low(1)),
        (_AND_K, 0, 0, _SOCK_TYPE_MASK),
    ]
    code += [(_JEQ_K, "allow", 0, kind) for kind in _PAIR_TYPES]
    code += [
        (_JEQ_K, "eperm", "eperm", 0),
        ("allow", 0, 0, 0),
        (_RET_K, 0, 0, _RET_ALLOW),
        ("eperm", 0, 0, 0),
        (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
        ("enosys", 0, 0, 0),
        (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS),
        ("eafnosupport", 0, 0, 0),
        (_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT),
        ("kill", 0, 0, 0),
        (_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    return code


def assemble(code: Sequence[Instruction]) -> bytes:
    """Resolve labels (an entry whose first field is a ``str`` marks the next instruction;
    jump fields may name one) into forward offsets and pack ``struct sock_filter``s."""
    labels: dict[str, int] = {}
    instructions: list[tuple[int, int | str, int | str, int]] = []
    for op, jt, jf, k in code:
        if isinstance(op, str):
            labels[op] = len(instructions)
        else:
            instructions.append((op, jt, jf, k))

    def offset(target: int | str, index: int) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - index - 1
        if not 0 <= jump <= 255:
            raise ValueError(f"seccomp filter: jump to {target} out of range ({jump})")
        return jump

    return b"".join(
        struct.pack("<HBBI", op, offset(jt, i), offset(jf, i), k)
        for i, (op, jt, jf, k) in enumerate(instructions)
    )


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def install(libc: ctypes.CDLL, filter_bytes: bytes) -> None:
    """Install ``filter_bytes`` on this thread (and every process it starts). Needs
    ``no_new_privs`` (or ``CAP_SYS_ADMIN``); raises ``OSError`` when the kernel refuses."""
    buffer = ctypes.create_string_buffer(filter_bytes, len(filter_bytes))
    fprog = _SockFprog(len(filter_bytes) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter: {os.strerror(err)}")

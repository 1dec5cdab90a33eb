"""A cgroup v2 per program: memory and processes bounded for the program as a whole.

Resource limits bind each process (``RLIMIT_AS`` per process, ``RLIMIT_NPROC`` per uid), and
kernel memory a process holds without mapping it (pipe buffers, socket buffers, tmpfs pages) is
in no limit at all. A cgroup counts every page charged to any process of the run: with
``memory.max`` the program as a whole gets ``memory_mb``, and its own out-of-memory kill
(``memory.oom.group``: all of it) instead of the machine's, which could pick the trainer.

A cgroup can be made only where the trainer may write a cgroup v2 folder whose
``cgroup.subtree_control`` gives its children the ``memory`` and ``pids`` controllers: a
delegated subtree (systemd ``Delegate=yes``, a container runtime's cgroup namespace with
delegation), named by the tool config's ``cgroup_parent``. The trainer's own cgroup serves only
where it already gives its children both controllers, which cgroup v2 allows only to a cgroup
without processes of its own (or the hierarchy's root). Nothing is moved or reconfigured: where
no folder serves, the layer is reported missing with the reason.

Parent side only (the trainer's process); init joins the folder by writing ``cgroup.procs``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time

_CONTROLLERS = ("memory", "pids")
_NAME_PREFIX = "megarl-sandbox-"


def delegated_parent(configured: str | None = None) -> tuple[str | None, str]:
    """The cgroup v2 folder runs get their cgroups in, or None and why not: ``configured``
    (tool config ``cgroup_parent``: a delegated folder made for the sandbox), else the
    trainer's own cgroup where it gives children memory and pids (cgroup v2 allows that only
    to a cgroup without processes of its own, or the hierarchy's root)."""
    if configured is not None:
        return _usable(configured, "the configured cgroup_parent")
    return _own_cgroup()


@functools.cache
def _own_cgroup() -> tuple[str | None, str]:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            table = [line.split() for line in f]
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError as e:
        return None, f"cannot read this process's cgroups ({e.strerror})"
    mounts = [m[1] for m in table if m[2:3] == ["cgroup2"]]
    if not mounts or own is None:
        return None, "no cgroup v2 hierarchy is mounted"
    folders = [os.path.join(m, own.lstrip("/")) for m in mounts]
    folder = next((f for f in folders if os.path.isdir(f)), None)
    if folder is None:
        return None, f"the trainer's cgroup {own} is not visible under {', '.join(mounts)}"
    parent, why_not = _usable(folder, "the trainer's cgroup v2")
    if parent is None and any(m[2:3] == ["cgroup"] and "memory" in m[3].split(",") for m in table):
        why_not += "; the memory controller is bound to a cgroup v1 hierarchy here (not used)"
    return parent, why_not


def _usable(folder: str, what: str) -> tuple[str | None, str]:
    enabled = _read(folder, "cgroup.subtree_control").split()
    if not all(c in enabled for c in _CONTROLLERS):
        available = _read(folder, "cgroup.controllers").split()
        return None, (
            f"{what} {folder} does not give its children {' and '.join(_CONTROLLERS)} "
            f"(subtree_control: {enabled or 'none'}; controllers: {available or 'none'}); "
            "set cgroup_parent to a delegated folder that does"
        )
    if not os.access(folder, os.W_OK):
        return None, f"{what} {folder} is not writable by the trainer"
    return folder, ""


def create(
    memory_mb: int, max_processes: int, configured_parent: str | None = None
) -> tuple[str | None, str]:
    """A new cgroup for one program: ``memory.max`` of ``memory_mb`` (no swap), ``pids.max``
    of ``max_processes`` plus init, killed as a whole when out of memory. Returns its folder,
    or None and why not."""
    parent, why_not = delegated_parent(configured_parent)
    if parent is None:
        return None, why_not
    folder = os.path.join(parent, f"{_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    settings = {
        "memory.max": str(memory_mb << 20),
        "memory.swap.max": "0",
        "memory.oom.group": "1",
        "pids.max": str(max_processes + 1),
    }
    try:
        os.mkdir(folder)
        for name, value in settings.items():
            if name == "memory.swap.max" and not os.path.exists(os.path.join(folder, name)):
                continue  # no swap accounting: nothing to limit
            with open(os.path.join(folder, name), "w", encoding="ascii") as f:
                f.write(value)
    except OSError as e:
        remove(folder)
        return None, f"cannot set up a cgroup under {parent} ({e.strerror})"
    return folder, ""


def remove(folder: str, timeout_s: float = 2.0) -> None:
    """Kill what is left in the cgroup (``cgroup.kill``, Linux >= 5.14) and remove it; a
    cgroup goes only once its last process was reaped."""
    with contextlib.suppress(OSError), open(os.path.join(folder, "cgroup.kill"), "w") as f:
        f.write("1")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _read(folder: str, name: str) -> str:
    try:
        with open(os.path.join(folder, name), encoding="ascii") as f:
            return f.read()
    except OSError:
        return ""

"""Run model-written Python code, which is hostile, without letting it harm the training run.

A policy that can call a code tool will, over millions of rollouts, write every program there is:
infinite loops, fork bombs, memory hogs, ``os.environ`` dumps (API keys), reads of the run's
checkpoints and data, writes into the repository, network calls. :func:`run_python` runs one
program so that each of those ends as a :class:`SandboxResult` within its :class:`SandboxLimits`
and leaves nothing behind: no process, no file, no changed state of the host.

How (each layer is documented in ``docs/sandbox.md``):

* a **launcher** (``confine.py`` run as a script by a fresh interpreter, so no fork of the
  multi-threaded trainer ever runs Python code) enters new namespaces, then forks an **init**
  that builds the confinement and forks the program: ``python -I -B -u -`` reading the code
  from stdin, with a cleared environment, in an empty temporary folder;
* **namespaces** (root: directly; unprivileged: inside a user namespace where the kernel allows):
  network (no interface but a down loopback: no network at all), PID (when init dies the kernel
  kills every process left, including ones that called ``setsid()``), mount (a private root
  holding only the system and Python installation, read-only, and a small in-memory work
  folder), IPC and UTS;
* an **unprivileged uid** (root only), fresh per run: the file permissions of everything else
  apply, ``RLIMIT_NPROC`` counts (the kernel exempts uid 0), and every process of the uid can be
  found and killed afterwards;
* **Landlock** (:mod:`~megarl.agent.sandbox.landlock`; unprivileged, Linux >= 5.13):
  read-only access to the system and Python, read-write to the temporary folder, no TCP
  bind/connect (ABI >= 4), no signals or abstract UNIX sockets out of the sandbox (ABI >= 6);
* ``no_new_privs`` (no set-uid binary can give privileges back) and **resource limits** (CPU
  seconds, address space, processes, file size, open files, no core dumps);
* kernel state that namespaces do not cover: a fresh **session keyring**, SysV **IPC limits**
  of the IPC namespace from ``memory_mb``, a **cgroup** v2 per program where a delegated
  folder serves (:mod:`~megarl.agent.sandbox.cgroup`), and last a **seccomp** filter
  (:mod:`~megarl.agent.sandbox.seccomp`: keyrings, namespaces, mounts, ptrace, bpf, io_uring,
  memfds, socket families outside the network namespace... refused);
* the **wall-clock timeout**, the output cap and the program's own exit all end the same
  way: the launcher SIGKILLs init's process group and init (whose death empties the PID
  namespace), kills orphans that come to it as subreaper and reaps everything; the parent then
  sweeps the run's uid and removes the cgroup and the folder (and, at its first call, the
  folders a killed trainer left).

A layer the machine does not allow is skipped and said so: every result carries a
:class:`SandboxReport` of what was applied and what was not, and ``require=`` turns a missing
layer into :class:`SandboxUnavailable` before any model code runs.

The package has two parts: :mod:`megarl.agent.sandbox.run`, the parent side (start the launcher,
feed the code, collect output, kill, clean up), and :mod:`megarl.agent.sandbox.confine`, the
launcher and init, which imports only the standard library (it is the launcher script) and
holds the definitions both sides share.
"""

from megarl.agent.sandbox.confine import LAYERS, REQUIREMENTS, SandboxReport
from megarl.agent.sandbox.run import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    probe,
    run_python,
)

__all__ = [
    "LAYERS",
    "REQUIREMENTS",
    "SandboxError",
    "SandboxLimits",
    "SandboxReport",
    "SandboxResult",
    "SandboxUnavailable",
    "probe",
    "run_python",
]

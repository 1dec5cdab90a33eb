"""A throw-away single-host Slurm cluster with emulated nodes, for tests (GUIDE section 4).

Runs as root with Debian's ``slurm-wlm`` + ``munge``: a private ``slurm.conf`` (``SLURM_CONF``)
whose state, spool, pid and log files live in a temp dir, one ``slurmctld`` and one ``slurmd -N``
per emulated node. Teardown stops only the daemons this object started (by the pids in its own
pid files) and removes its temp dir; a ``munged`` that was already running is left alone.

Usable by hand too::

    python tests/slurm/local_cluster.py up   # prints `export SLURM_CONF=...`; Ctrl-C/SIGTERM tears down
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SLURM_BINARIES = ("sbatch", "squeue", "sinfo", "slurmctld", "slurmd", "scontrol")
MUNGED = "/usr/sbin/munged"


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here, or None."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if not Path(MUNGED).exists():
        return "munge is not installed (apt-get install munge)"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs as root)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_conf(
    root: Path, nodes: list[str], cpus: int, ctld_port: int, node_ports: list[int]
) -> str:
    host = socket.gethostname().split(".")[0]
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
        "RealMemory=8000 State=UNKNOWN"
        for n, p in zip(nodes, node_ports, strict=True)
    )
    return f"""\
ClusterName=megarltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=30
SlurmdTimeout=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass
class LocalSlurm:
    num_nodes: int = 2
    cpus_per_node: int = 2
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="megarl-slurm-")))
    started_munged_pid: int | None = None

    @property
    def nodes(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.num_nodes)]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 60) -> LocalSlurm:
        self._ensure_munged()
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        ports = [_free_port() for _ in range(self.num_nodes + 1)]
        (self.root / "slurm.conf").write_text(
            _slurm_conf(self.root, self.nodes, self.cpus_per_node, ports[0], ports[1:])
        )
        self._run(["slurmctld", "-i"])
        for node in self.nodes:
            self._run(["slurmd", "-N", node])
        self._wait_idle(timeout_s)
        return self

    def _ensure_munged(self) -> None:
        probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
        if probe.returncode == 0:
            return  # someone else's munged: use it, never stop it
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", MUNGED], check=True)
        pid_file = Path("/run/munge/munged.pid")
        for _ in range(50):
            if pid_file.exists() and pid_file.read_text().strip():
                self.started_munged_pid = int(pid_file.read_text().strip())
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not start (no /run/munge/munged.pid)")

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True
            )
            state = out.stdout.strip()
            idle = [line for line in state.splitlines() if line.endswith("idle")]
            if len(idle) == self.num_nodes:
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"Slurm nodes not idle within {timeout_s:.0f} s: {state!r}; logs in {self.root}"
        )

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
        done = subprocess.run(
            ["sbatch", "--parsable", *args],
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(done.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        """State from ``scontrol`` (no accounting here); '' once the job is forgotten."""
        out = subprocess.run(
            ["scontrol", "-o", "show", "job", str(job_id)],
            env=self.env,
            capture_output=True,
            text=True,
        )
        for token in out.stdout.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return ""

    def wait(self, job_id: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(0.5)
        subprocess.run(["scancel", str(job_id)], env=self.env)
        raise TimeoutError(f"job {job_id} still {state or 'unknown'} after {timeout_s:.0f} s")

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        pid_files = [self.root / f"slurmd-{n}.pid" for n in self.nodes]
        pid_files.append(self.root / "slurmctld.pid")
        for pid_file in pid_files:
            _terminate_pid_from(pid_file)
        if self.started_munged_pid is not None:
            _terminate(self.started_munged_pid)
        shutil.rmtree(self.root, ignore_errors=True)


def _terminate_pid_from(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    _terminate(pid)


def _terminate(pid: int, wait_s: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["up"]:
        sys.exit("usage: local_cluster.py up")
    reason = missing_requirements()
    if reason:
        sys.exit(reason)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cluster = LocalSlurm().start()
    print(
        f"export SLURM_CONF={cluster.root / 'slurm.conf'}  # stop: kill -TERM {os.getpid()}",
        flush=True,
    )
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()

"""Single-machine launcher: run a function on N worker processes that form one process group.

``trainer.launcher=local``. A world of one runs in-process (no spawn cost, easy debugging).
Otherwise N processes are spawned; if any dies, the others are terminated and
:class:`WorkerFailed` names the rank and exit code, so a crash never becomes a hang.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from megarl.errors import MegarlError

POLL_S = 0.2
CAUSE_GRACE_S = 1.0  # how long a peer's error waits for a killed rank to be seen


class WorkerFailed(RuntimeError):
    """A worker process exited abnormally; ``exit_code`` is what the command line returns."""

    def __init__(
        self, rank: int, exitcode: int | None, detail: str = "", where: str = "", exit_code: int = 1
    ):
        self.rank, self.exitcode, self.exit_code = rank, exitcode, exit_code
        # `where` names role, rank and node (Ray launcher); the local launcher has one node.
        who = where or f"{role_of(rank)} rank {rank} on node {socket.gethostname()}"
        code = f" (exit code {exitcode})" if exitcode is not None else ""
        super().__init__(f"{who} failed{code}{': ' + detail if detail else ''}")


def role_of(rank: int) -> str:
    """What a rank hosts, for failure reports: rank 0 also runs the rollout engine (colocated)."""
    return "actor+rollout" if rank == 0 else "actor"


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function receives: its rank and where the group rendezvous is."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_entry(
    rank: int, fn: Callable, world_size: int, port: int, args: tuple, error_queue
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("MEGARL_WORKER_THREADS", "1"))
    ctx = WorkerContext(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    try:
        result = fn(ctx, *args)
        # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory
        # handles, which vanish when this process exits before the parent reads them.
        error_queue.put((rank, "ok", pickle.dumps(result)))
    except SystemExit as exc:  # a clean, already-reported error (e.g. bad config)
        error_queue.put((rank, "exit", int(exc.code or 0)))
        raise
    except MegarlError as exc:  # explained in one line: no traceback
        error_queue.put((rank, "error", (exc.exit_code, str(exc))))
        raise SystemExit(exc.exit_code) from None
    except BaseException as exc:  # noqa: BLE001 - reported; the parent prints the cause
        error_queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        # Not re-raised: multiprocessing would print every rank's traceback, and the peers of a
        # rank that failed ("connection closed by peer") would bury its one line.
        raise SystemExit(1) from None


def launch(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float | None = None
) -> list[Any]:
    """Run ``fn(WorkerContext, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (a module-level function): workers are spawned, not forked, because
    forking a process that already holds threads or a process group is unsafe.
    """
    if world_size == 1:
        return [fn(WorkerContext(0, 1, "127.0.0.1", find_free_port()), *args)]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker_entry, args=(rank, fn, world_size, port, args, queue), daemon=False
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world_size:
            _drain(queue, results, errors)
            if errors or _silently_dead(procs, results, errors):
                _raise_root_cause(procs, queue, results, errors)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers did not finish within {timeout_s:.0f} s")
            time.sleep(POLL_S)
        for proc in procs:
            proc.join(timeout=30)
        return [pickle.loads(results[r]) for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# --- which rank caused a failure ----------------------------------------------------
# When one rank is killed (SIGKILL, OOM killer), its peers fail a moment later inside a collective
# ("connection closed by peer") and report that as a Python error, often before the parent has
# even seen the dead process. The killed rank is the cause, so it is named, not its peers.


def _drain(queue, results: dict[int, Any], errors: dict[int, Any]) -> None:
    while not queue.empty():
        rank, status, payload = queue.get()
        (results if status == "ok" else errors)[rank] = payload


def _silently_dead(procs, results, errors) -> list[tuple[int, int]]:
    """Ranks that exited abnormally without reporting anything: killed or crashed natively."""
    return [
        (r, p.exitcode)
        for r, p in enumerate(procs)
        if p.exitcode not in (None, 0) and r not in results and r not in errors
    ]


def _raise_root_cause(procs, queue, results, errors) -> None:
    """Give a killed rank ``CAUSE_GRACE_S`` to be seen dead, then name it (or the lowest rank with
    a Python error). A reporting rank writes its message before it exits, so exit codes are read
    before the queue: a rank dead with its message still unread is never taken as killed."""
    grace_end = time.monotonic() + CAUSE_GRACE_S
    while True:
        dead = _silently_dead(procs, results, errors)
        _drain(queue, results, errors)
        killed = [(r, code) for r, code in dead if r not in errors and r not in results]
        if killed:
            rank, code = killed[0]
            peers = f"; then {len(errors)} other rank(s) failed" if errors else ""
            raise WorkerFailed(rank, code, f"killed or crashed without a Python error{peers}")
        if time.monotonic() >= grace_end:
            break
        time.sleep(POLL_S / 4)
    rank = min(errors)
    payload = errors[rank]
    if isinstance(payload, int):
        raise SystemExit(payload)
    if isinstance(payload, tuple):  # a MegarlError: its own one line and exit code
        exit_code, message = payload
        raise WorkerFailed(rank, None, message, exit_code=exit_code)
    raise WorkerFailed(rank, procs[rank].exitcode, payload)

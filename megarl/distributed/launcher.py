"""Single-machine launcher: run a function on N worker processes that form one process group.

``trainer.launcher=local``. A world of one runs in-process (no spawn cost, easy debugging).
Otherwise N processes are started; if any dies, the others are terminated and
:class:`WorkerFailed` names the rank and exit code, so a crash never becomes a hang. With a
:class:`HeartbeatWatch`, a rank whose main loop stops is named too (see
:mod:`megarl.distributed.heartbeat`).

How workers start (:func:`start_method`): never by a plain ``fork`` of the launcher, which may
already hold threads or a process group. Off CUDA they are forked from multiprocessing's *fork
server*, a clean single-threaded process that imported torch, Megatron-Core and transformers
once (:data:`WARM_MODULES`): importing them costs several CPU-seconds per process, more than a
tiny model's whole step, and a launcher that starts many runs (a test session, a sweep) pays it
once instead of once per rank per run. With CUDA they are spawned fresh, because a process that
has touched the CUDA driver must not be forked and an import may touch it. A forked worker takes
the launcher's environment and standard streams as they are when it starts, like a spawned one
(the fork server's own are those of its start). ``MEGARL_WORKER_START=spawn`` forces spawning.
Every one of these processes hides the same known, harmless third-party warnings
(:mod:`megarl.distributed.quiet`).

Workers die with the launcher: each asks the kernel for SIGKILL when its parent exits
(``PR_SET_PDEATHSIG``, Linux; the parent is the launcher, or the fork server, which exits when
the launcher does) and watches the launcher from a daemon thread (the fallback where prctl is
missing, and for a launcher that died before the request). A launcher stopped by SIGTERM or
SIGINT (:func:`stop_on_signals`) terminates and joins its workers before it exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.distributed import heap, heartbeat, quiet
from megarl.distributed.heartbeat import STALE_GRACE_S, Beat, HeartbeatWatch
from megarl.distributed.processes import descendants, kill_all, process_lives
from megarl.errors import MegarlError, RunAborted, RunStopped
from megarl.user_code import describe_user_exception

POLL_S = 0.2
CAUSE_GRACE_S = 1.0  # how long a peer's error waits for a killed rank to be seen
PARENT_POLL_S = 1.0  # how often a worker's fallback watch checks that its launcher lives
WATCH_POLL_S = 1.0  # how often the launcher reads the heartbeats
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
START_METHOD_ENV = "MEGARL_WORKER_START"
WARM_MODULES: tuple[str, ...] = (
    quiet.__name__,  # first: the server is a fresh interpreter, without the launcher's filters
    "megarl.trainer.rank_loop",
    "megarl.actor.megatron_actor",
    "megarl.critic.megatron_critic",
    "megarl.engines.hf",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.moe_layer",
    "transformers",
)
"""What the fork server imports before it forks a worker: the known-warning filters
(:mod:`megarl.distributed.quiet`, before the libraries that warn), the rank loop and the heavy
libraries its ranks import when they build a model (torch, Megatron-Core, transformers). The
rollout engines' own (vLLM) are not among them: only the runs that use them import them."""


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise :class:`RunStopped` in the main thread for this block, so the
    launcher's cleanup (terminating workers, releasing the run directory) runs before it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, _frame):
        raise RunStopped(signum)

    previous = {sig: signal.signal(sig, _raise) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class WorkerFailed(RuntimeError):
    """A worker process exited abnormally; ``exit_code`` is what the command line returns."""

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        detail: str = "",
        where: str = "",
        exit_code: int = 1,
        traceback: str = "",
    ):
        self.rank, self.exitcode, self.exit_code = rank, exitcode, exit_code
        self.traceback = traceback
        """The rank's Python traceback, if it raised (kept off the one line; see train.py)."""
        # `where` names role, rank and node (Ray launcher); the local launcher has one node.
        who = where or f"{role_of(rank)} rank {rank} on node {socket.gethostname()}"
        code = f" (exit code {exitcode})" if exitcode is not None else ""
        super().__init__(f"{who} failed{code}{': ' + detail if detail else ''}")


def role_of(rank: int) -> str:
    """What a rank hosts, for failure reports: rank 0 also runs the rollout engine (colocated)."""
    return "actor+rollout" if rank == 0 else "actor"


# --- failure reports, the same under both launchers -------------------------------------------


def stuck_rank_report(beat: Beat, now: float, peers_failed: int, where: str = "") -> WorkerFailed:
    """The one line for a rank whose main loop stopped: how long it made no progress, in which
    phase, and how many peers failed after it (their errors, timeouts waiting for it, are its
    consequence). ``where`` (the Ray launcher's placement) defaults to role, rank and the node
    its heartbeat names."""
    peers = f"; then {peers_failed} other rank(s) failed" if peers_failed else ""
    detail = beat.describe(now, with_pid=not where) + peers  # a placement names the pid
    where = where or f"{role_of(beat.rank)} rank {beat.rank} on node {beat.host}"
    return WorkerFailed(beat.rank, None, detail, where=where)


def raised_error_report(
    rank: int,
    error: str,
    trace: str,
    beat: Beat | None,
    where: str = "",
    exitcode: int | None = None,
) -> WorkerFailed:
    """The one line for a rank whose code raised: the error's first line and the phase its main
    loop was in (from its heartbeat, when it has one); the traceback travels on the exception,
    kept off the line (``megarl.train`` writes it to ``logs/error-rank<N>.txt``)."""
    during = f" during {beat.during}" if beat is not None else ""
    summary = error.splitlines()[0] if error else "error"
    return WorkerFailed(rank, exitcode, summary + during, where=where, traceback=trace)


def raise_if_stuck(
    watch: HeartbeatWatch,
    live: dict[int, int],
    failed: dict[int, int],
    older_than_s: float,
    in_steps_only: bool = False,
    where: Callable[[int], str] | None = None,
    timed_out: frozenset[int] = frozenset(),
) -> None:
    """Raise :func:`stuck_rank_report` for the rank of ``live`` (``{rank: pid}``) whose main
    loop stopped first, if it has been stuck longer than ``older_than_s`` and before the
    ``failed`` ranks last advanced (see :meth:`HeartbeatWatch.stalest`). ``where(rank)``: the
    launcher's own text for where a rank runs.

    The ``timed_out`` ranks of ``failed`` failed because a collective waited too long: they
    were waiting for a peer, so when they entered their wait says nothing of who stopped first
    (rank 0 writes metrics and a checkpoint after a step's last collective, so its peers reach
    the next step's first collective before it even starts the step); a stuck live rank is
    named whatever its time."""
    ordering = {rank: pid for rank, pid in failed.items() if rank not in timed_out}
    beat = watch.stalest(live, older_than_s, ordering, in_steps_only)
    if beat is not None:
        place = where(beat.rank) if where is not None else ""
        raise stuck_rank_report(beat, time.time(), len(failed), place)


_COLLECTIVE_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def is_collective_timeout(error: str) -> bool:
    """A rank's error that is its collective giving up on a peer (gloo's "Timed out waiting
    ... ms", NCCL's watchdog timeout), judged by the error's first line."""
    return bool(_COLLECTIVE_TIMEOUT.search(error.split("\n", 1)[0]))


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function receives: its rank and where the group rendezvous is."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    heartbeat_dir: str | None = None
    """Where this rank publishes its heartbeat for the launcher; None: nobody watches."""
    store_hosted: bool = False
    """The launcher holds the rendezvous store on ``master_port`` and rank 0 connects to it
    like the others; otherwise rank 0 opens it there."""


def rendezvous_store() -> dist.TCPStore:  # pyright: ignore[reportPrivateImportUsage]
    """The ranks' rendezvous, held by the launcher on a port the OS picks as it binds.

    Picking a free port and letting rank 0 bind it later loses the port whenever another
    process takes it in between (seen in the test suite, where several runs start side by side
    and gloo opens connections on ephemeral ports: ``EADDRINUSE`` in rank 0). Kept alive by the
    caller until the ranks are done."""
    # public, but not in the module's __all__
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # pyright: ignore[reportPrivateImportUsage]


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_method() -> str:
    """``forkserver`` off CUDA, ``spawn`` with it (see the module docstring), unless
    ``MEGARL_WORKER_START`` names one of them."""
    forced = os.environ.get(START_METHOD_ENV)
    if forced in ("spawn", "forkserver"):
        return forced
    return "spawn" if torch.cuda.is_available() else "forkserver"


def _die_with_launcher(launcher_pid: int, forked: bool) -> None:
    """End this worker when its launcher ends, however it ends (SIGKILL too).

    The kernel sends SIGKILL when the parent *thread* exits: the launcher's main thread for a
    spawned worker, the fork server for a forked one (the server exits when the launcher
    does). A watch thread covers systems without prctl and a launcher that died before the
    request: a spawned worker's parent must be the launcher; a forked one's must stay the same
    server, and the launcher must exist.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = os.getppid()

    def launcher_alive() -> bool:
        if not forked:
            return os.getppid() == launcher_pid
        return os.getppid() == parent and process_lives(launcher_pid)

    if not launcher_alive():
        os._exit(1)

    def watch() -> None:
        while launcher_alive():
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="megarl-parent-watch", daemon=True).start()


class _LauncherState:
    """The launcher's environment and standard streams, carried to a forked worker (which would
    otherwise keep the fork server's, as they were when the server started)."""

    def __init__(self, forked: bool):
        self.environ = dict(os.environ) if forked else {}
        self.forked = forked

    def __reduce__(self):
        if not self.forked:  # spawned: inherits both already
            return (_LauncherState, (False,))
        out, err = (reduction.DupFd(fd) for fd in (1, 2))  # only while a worker is started
        return (_restore_launcher_state, (self.environ, out, err))


def _restore_launcher_state(environ: dict[str, str], out, err) -> _LauncherState:
    """In a forked worker, before anything else of its arguments is unpickled."""
    os.environ.clear()
    os.environ.update(environ)
    for dup, fd in ((out, 1), (err, 2)):
        inherited = dup.detach()
        os.dup2(inherited, fd)
        os.close(inherited)
    return _LauncherState(forked=True)


def _worker_entry(
    launcher_state: _LauncherState,
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    args: tuple,
    error_queue,
    launcher_pid: int,
    heartbeat_dir: str | None,
) -> None:
    """A worker's main; ``launcher_state`` was applied while it was unpickled."""
    heap.own_this_process()  # before anything: what the fork server imported, out of the GC's walk
    _die_with_launcher(launcher_pid, launcher_state.forked)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("MEGARL_WORKER_THREADS", "1"))
    ctx = WorkerContext(rank, world_size, "127.0.0.1", port, heartbeat_dir, store_hosted=True)
    try:
        result = fn(ctx, *args)
        # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory
        # handles, which vanish when this process exits before the parent reads them.
        error_queue.put((rank, "ok", pickle.dumps(result)))
    except SystemExit as exc:
        if not is_reported_exit(exc):  # no rank's work ends in an exit: never a success
            error_queue.put((rank, "error", (1, early_exit_line(exc))))
            raise SystemExit(1) from None
        error_queue.put((rank, "exit", exc.code))  # a clean, already-reported error
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
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout_s: float | None = None,
    watch: HeartbeatWatch | None = None,
) -> list[Any]:
    """Run ``fn(WorkerContext, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (a module-level function): workers never share the launcher's
    memory (see :func:`start_method`). With ``watch``, each rank is told where to publish its
    heartbeat and a rank that stops is named.
    """
    quiet.install()  # here, where a world of one runs; the fork server installs its own
    if world_size == 1:
        return [_run_in_process(fn, args, watch)]
    forked = start_method() == "forkserver"
    if forked:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(WARM_MODULES))  # takes effect when the server starts
    else:
        ctx = mp.get_context("spawn")
    state = _LauncherState(forked)
    queue = ctx.SimpleQueue()
    store = rendezvous_store()
    port = store.port
    if watch is not None:
        watch.reset()
    beat_dir = watch.folder if watch is not None else None
    procs = [
        ctx.Process(
            target=_worker_entry,
            args=(state, rank, fn, world_size, port, args, queue, os.getpid(), beat_dir),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        return _wait(procs, queue, timeout_s, watch)
    finally:
        _stop(procs)
        if watch is not None:
            watch.reset()


# --- a world of one: the rank runs in the launcher's own process ---------------------------


class Unresponsive(RunAborted):
    """Raised in the main thread of a one-process run by its watch: the rank stopped making
    progress. A :class:`RunAborted`, so no catch of the user's errors (a reward function's,
    a tool's) takes it for theirs; :func:`launch` turns it into the rank's report."""

    def __init__(self, report: WorkerFailed):
        super().__init__(str(report))
        self.report = report


class InProcessWatch:
    """The launcher's watch over a rank that runs in its own process (a world of one).

    Spawned ranks are watched from the launcher's process; a rank in that very process has no
    outside, so a daemon thread reads the rank's heartbeat with the same rule as for spawned
    ranks (no progress inside the step loop for the timeout + :data:`STALE_GRACE_S`). When it
    fires, it interrupts the main thread with SIGINT, whose handler (installed here, in front of
    the launcher's) raises :class:`Unresponsive` there: a blocking call (a sleep, a socket read,
    a lock) is interrupted and the run unwinds, closing the engine and releasing the run
    directory. A main thread that does not unwind within :data:`HARD_EXIT_AFTER_S` (stuck in
    native code) is ended: the line is printed, the process's children are killed and the
    process exits with 1 (checkpoints are published by rename, so none is torn).
    """

    HARD_EXIT_AFTER_S = 15.0

    def __init__(self, watch: HeartbeatWatch, older_than_s: float):
        self.watch, self.older_than_s = watch, older_than_s
        self.report: WorkerFailed | None = None
        self._done = threading.Event()
        self._previous: Any = None

    def __enter__(self) -> InProcessWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        threading.Thread(target=self._loop, name="megarl-watch", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.report is not None:
            raise Unresponsive(self.report)
        if callable(self._previous):
            self._previous(signum, frame)
        elif self._previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    def _loop(self) -> None:
        pid = os.getpid()
        while not self._done.wait(WATCH_POLL_S):
            beat = self.watch.stalest({0: pid}, self.older_than_s, in_steps_only=True)
            if beat is not None:
                self._fire(stuck_rank_report(beat, time.time(), 0))
                return

    def _fire(self, report: WorkerFailed) -> None:
        self.report = report
        if self._previous is not None:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            if self._done.wait(self.HARD_EXIT_AFTER_S):
                return
        print(
            f"megarl-train: error: {report} (its main thread did not respond; the process was "
            "ended)",
            file=sys.stderr,
            flush=True,
        )
        kill_all(descendants(os.getpid()))  # the engine's processes
        os._exit(1)


def is_reported_exit(exc: SystemExit) -> bool:
    """A rank's ``SystemExit`` that ends the run with its own, non-zero code (an error already
    reported); one of code 0, None or ``False``, or not a number, is a rank that stopped before
    its work was done and must fail the run (exit 1), never end it as a success."""
    code = exc.code
    return isinstance(code, int) and not isinstance(code, bool) and code != 0


def early_exit_line(exc: SystemExit) -> str:
    """The line for a rank that raised :func:`is_reported_exit`'s other kind of exit."""
    return (
        f"the rank raised {describe_user_exception(exc)} before its work was done "
        "(a SystemExit from code it called, outside the calls into user code that catch it)"
    )


def _run_in_process(fn: Callable[..., Any], args: tuple, watch: HeartbeatWatch | None) -> Any:
    """``fn`` as rank 0 of a world of one, here; with ``watch``, an :class:`InProcessWatch`."""
    ctx = WorkerContext(0, 1, "127.0.0.1", find_free_port(), watch.folder if watch else None)
    try:
        return _run_in_process_watched(fn, args, watch, ctx)
    except SystemExit as exc:
        if is_reported_exit(exc):
            raise
        raise WorkerFailed(0, None, early_exit_line(exc)) from exc


def _run_in_process_watched(
    fn: Callable[..., Any], args: tuple, watch: HeartbeatWatch | None, ctx: WorkerContext
) -> Any:
    with _process_state_restored():
        if watch is None:
            return fn(ctx, *args)
        watch.reset()
        try:
            with InProcessWatch(watch, watch.timeout_s + STALE_GRACE_S):
                return fn(ctx, *args)
        except Unresponsive as stuck:
            raise stuck.report from None
        finally:
            heartbeat.stop()  # the next run in this process (a test session) starts its own
            watch.reset()


@contextlib.contextmanager
def _process_state_restored():
    """A rank run here must leave this process as it found it, however it ended: a process
    group or model-parallel state it left behind makes the next run in this process (the next
    model of a benchmark, the next test) fail with "initialize the default process group
    twice", and CPU shims left on would move that run's CUDA tensors to the CPU."""
    from megarl.distributed import platform

    depth = platform.shims_depth()
    try:
        yield
    finally:
        platform.restore_shims_depth(depth)
        if "megatron.core.parallel_state" in sys.modules or torch.distributed.is_initialized():
            from megarl.distributed import parallel

            parallel.destroy()


def _wait(procs, queue, timeout_s: float | None, watch: HeartbeatWatch | None) -> list[Any]:
    results: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    next_watch = time.monotonic() + WATCH_POLL_S
    while len(results) + len(errors) < len(procs):
        _drain(queue, results, errors)
        if errors or _silently_dead(procs, results, errors):
            _raise_root_cause(procs, queue, results, errors, watch)
        if watch is not None and time.monotonic() >= next_watch:
            next_watch = time.monotonic() + WATCH_POLL_S
            _raise_if_stuck(procs, results, errors, watch, watch.timeout_s + STALE_GRACE_S, True)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"workers did not finish within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    for proc in procs:
        proc.join(timeout=30)
    return [pickle.loads(results[r]) for r in range(len(procs))]


def _stop(procs) -> None:
    """Terminate (SIGTERM) the workers still running, join them, SIGKILL any that linger, then
    SIGKILL what they had started (a vLLM engine core still starting up would otherwise wait
    minutes for its dead parent's handshake)."""
    below = [pid for proc in procs if proc.is_alive() for pid in descendants(proc.pid)]
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    kill_all(below)


def _raise_if_stuck(
    procs, results, errors, watch: HeartbeatWatch, older_than_s: float, in_steps_only: bool = False
) -> None:
    """Name the live, silent rank whose main loop stopped first, if it has been stuck longer
    than ``older_than_s``; its peers' errors (if any) are what it caused."""
    live = {
        r: p.pid
        for r, p in enumerate(procs)
        if p.is_alive() and r not in results and r not in errors
    }
    failed = {r: procs[r].pid for r in errors}
    timed_out = frozenset(
        r for r, error in errors.items() if isinstance(error, str) and is_collective_timeout(error)
    )
    raise_if_stuck(watch, live, failed, older_than_s, in_steps_only, timed_out=timed_out)


# --- which rank caused a failure ----------------------------------------------------
# When one rank is killed (SIGKILL, OOM killer), its peers fail a moment later inside a collective
# ("connection closed by peer") and report that as a Python error, often before the parent has
# even seen the dead process. The killed rank is the cause, so it is named, not its peers.


def _drain(queue, results: dict[int, Any], errors: dict[int, Any]) -> None:
    while not queue.empty():
        rank, status, payload = queue.get()
        (results if status == "ok" else errors)[rank] = payload


def _silently_dead(procs, results, errors) -> list[tuple[int, int]]:
    """Ranks that exited without reporting anything: killed or crashed natively, or ended by
    ``os._exit`` -- with status 0 too (a rank that finished reports its result first)."""
    return [
        (r, p.exitcode)
        for r, p in enumerate(procs)
        if p.exitcode is not None and r not in results and r not in errors
    ]


def _dead_rank_report(
    rank: int, exitcode: int, pid: int, peers_failed: int, watch: HeartbeatWatch | None
) -> WorkerFailed:
    """The line for a rank that died without a Python error: its exit status, the phase its
    heartbeat last named and the user code it was running then (a tool that called
    ``os._exit``, an extension that segfaulted: nothing was raised to name it)."""
    beat = watch.read({rank: pid}).get(rank) if watch is not None else None
    how = (
        "exited with status 0 before its work was done, without a Python error"
        if exitcode == 0
        else "killed or crashed without a Python error"
    )
    during = f" during {beat.during}" if beat is not None else ""
    peers = f"; then {peers_failed} other rank(s) failed" if peers_failed else ""
    return WorkerFailed(rank, exitcode, f"{how}{during}{peers}")


def _raise_root_cause(procs, queue, results, errors, watch: HeartbeatWatch | None = None) -> None:
    """Give a killed rank ``CAUSE_GRACE_S`` to be seen dead, then name it, or a live rank stuck
    for half the collective timeout (its peers' collectives timed out waiting for it), or the
    lowest rank with a Python error. A reporting rank writes its message before it exits, so exit
    codes are read before the queue: a rank dead with its message still unread is never taken as
    killed."""
    grace_end = time.monotonic() + CAUSE_GRACE_S
    while True:
        dead = _silently_dead(procs, results, errors)
        _drain(queue, results, errors)
        killed = [(r, code) for r, code in dead if r not in errors and r not in results]
        if killed:
            rank, code = killed[0]
            raise _dead_rank_report(rank, code, procs[rank].pid, len(errors), watch)
        if not errors:  # the rank seen dead had reported after all (it finished)
            return
        if time.monotonic() >= grace_end:
            break
        time.sleep(POLL_S / 4)
    if watch is not None:
        _raise_if_stuck(procs, results, errors, watch, watch.timeout_s / 2)
    rank = min(errors)
    payload = errors[rank]
    if isinstance(payload, int):
        raise SystemExit(payload)
    if isinstance(payload, tuple):  # a MegarlError: its own one line and exit code
        exit_code, message = payload
        raise WorkerFailed(rank, None, message, exit_code=exit_code)
    summary, _, trace = str(payload).partition("\n")
    beat = watch.read({rank: procs[rank].pid}).get(rank) if watch is not None else None
    raise raised_error_report(rank, summary, trace, beat, exitcode=procs[rank].exitcode)

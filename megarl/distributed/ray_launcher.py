"""Ray launcher (``trainer.launcher=ray``): the same per-rank entry point as the local launcher,
placed on a Ray cluster that may span several nodes.

The controller is named steps (:func:`launch_on_ray`):

1. connect     -- join the cluster named by ``RAY_ADDRESS`` (the Slurm script sets it), else
                  start a private local Ray;
2. reserve     -- one placement-group bundle per node (``STRICT_SPREAD`` over ``nnodes``), each
                  holding ``n_gpus_per_node`` GPUs, or a small CPU fraction per rank on CPU so a
                  2-core machine can place several ranks;
3. start ranks -- one :class:`RankActor` per Megatron rank, node-major like Megatron's rank order;
   (split rollout placement: the rollout actor first, on a placement group of its own, see
   :class:`SideActor`; it reports where it landed);
4. rendezvous  -- ``MASTER_ADDR`` is rank 0's node IP, the port is free on that node;
5. run         -- every rank runs ``fn(WorkerContext, *args)`` (gloo on CPU, NCCL on GPU); the first
                  rank to die or raise stops the run with :class:`WorkerFailed` naming role, rank
                  and node, and every actor and the placement group are released. A rank that
                  finds the rollout actor dead raises :class:`SideActorFailed`, and the report
                  names the rollout actor and its node instead of the rank that noticed. With a
                  :class:`HeartbeatWatch`, a rank whose main loop stopped is named as under the
                  local launcher (the same checks and report, :mod:`megarl.distributed.launcher`).

A SIGTERM or SIGINT that the caller turns into an exception (``stop_on_signals``) stops the run
the same way: the actors are killed, and their death confirmed, before it propagates.

:class:`RankActor` is a plain class (tests build it without Ray); the Ray actor is a thin shell
made by ``ray.remote(RankActor)`` at launch time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megarl.distributed import heap, quiet, ray_reaper
from megarl.distributed.heartbeat import STALE_GRACE_S, HeartbeatWatch
from megarl.distributed.launcher import (
    WATCH_POLL_S,
    WorkerContext,
    WorkerFailed,
    early_exit_line,
    is_collective_timeout,
    is_reported_exit,
    raise_if_stuck,
    raised_error_report,
    role_of,
)
from megarl.errors import MegarlError

CPU_PER_RANK = 0.01
"""Ray CPU resource per rank on CPU runs: a token amount, so placement never waits for cores."""
RESERVE_TIMEOUT_S = float(os.environ.get("MEGARL_RAY_RESERVE_TIMEOUT_S", 120))
POLL_S = 0.5
CAUSE_GRACE_S = 2.0  # how long a rank's error waits for Ray to report a killed peer
LOCAL_START_ATTEMPTS = 3
KILL_WAIT_S = 10.0
"""How long the controller waits for Ray to confirm that the killed actors are dead."""


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested layout (too few nodes or resources)."""


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank landed: reported when it fails."""

    rank: int
    role: str
    node_ip: str
    hostname: str
    node_id: str
    pid: int

    def describe(self) -> str:
        return f"{self.role} rank {self.rank} on {_node_text(self)}"


@dataclass(frozen=True)
class ActorPlacement:
    """Where an actor outside the rank group (split placement's rollout) landed."""

    role: str
    node_ip: str
    hostname: str
    node_id: str
    pid: int

    @classmethod
    def here(cls, role: str) -> ActorPlacement:
        """The calling process's placement (call it inside the actor)."""
        return cls(
            role=role,
            node_ip=node_ip(),
            hostname=socket.gethostname(),
            node_id=ray_node_id(),
            pid=os.getpid(),
        )

    def describe(self) -> str:
        return f"{self.role} actor on {_node_text(self)}"


def _node_text(p: RankPlacement | ActorPlacement) -> str:
    return f"node {p.hostname} ({p.node_ip}, ray node {p.node_id[:8]}, pid {p.pid})"


class SideActorFailed(RuntimeError):
    """A rank's call into a side actor (split placement's rollout) found it dead or raising.

    Raised in the rank (it crosses back to the controller pickled, as the rank task's cause) so
    the report names the side actor and its node, not the rank that happened to notice.
    """

    def __init__(self, where: str, detail: str, exit_code: int = 1, traceback: str = ""):
        super().__init__(where, detail, exit_code, traceback)  # all four survive pickling
        self.where, self.detail, self.exit_code = where, detail, exit_code
        self.traceback = traceback
        """The side actor's remote traceback, for an unexpected error (a bug, a user loop's
        exception): the report keeps it off the line and writes it to the run's log."""

    def __str__(self) -> str:
        return f"{self.where} failed: {self.detail}"


def get_from_side_actor(ref, where: str, call: str = "", timeout_s: float | None = None) -> Any:
    """``ray.get`` on a side actor's call; its death, its error or (with ``timeout_s``) no
    answer in time becomes :class:`SideActorFailed`."""
    import ray.exceptions

    during = f" during {call}" if call else ""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise SideActorFailed(where, f"no answer within {timeout_s:g} s{during}") from None
    except ray.exceptions.RayActorError as exc:
        raise SideActorFailed(where, _death_cause(exc) + during) from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        if isinstance(cause, MegarlError):  # explained in one line, with its own exit code
            raise SideActorFailed(where, f"{cause}{during}", cause.exit_code) from None
        detail = f"{type(cause).__name__}: {cause}".splitlines()[0]
        raise SideActorFailed(where, f"{detail}{during}", traceback=str(exc)) from None


@dataclass(frozen=True)
class RayLayout:
    """How ranks map onto nodes and what each one reserves."""

    nnodes: int
    ranks_per_node: int
    device: str

    @property
    def world_size(self) -> int:
        return self.nnodes * self.ranks_per_node

    def bundles(self) -> list[dict[str, float]]:
        return [self.bundle() for _ in range(self.nnodes)]

    def bundle(self) -> dict[str, float]:
        per_rank = self.rank_resources()
        return {k: v * self.ranks_per_node for k, v in per_rank.items()}

    def rank_resources(self) -> dict[str, float]:
        if self.device == "cuda":
            return {"CPU": 1.0, "GPU": 1.0}
        return {"CPU": CPU_PER_RANK}

    def strategy(self) -> str:
        return "STRICT_SPREAD" if self.nnodes > 1 else "PACK"

    def node_index(self, rank: int) -> int:
        return rank // self.ranks_per_node


FORWARDED_ENV_PREFIXES = ("MEGARL_", "WANDB_")
"""The driver's settings that travel to every Ray actor: megarl's own (timeouts, test hooks) and
wandb's (``WANDB_MODE``, ``WANDB_DIR``, ``WANDB_API_KEY``...), which the actor that logs
metrics reads; an actor on a node of a running cluster does not inherit the driver's
environment."""


def forwarded_env() -> dict[str, str]:
    """The driver's environment variables named by :data:`FORWARDED_ENV_PREFIXES`."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class RankActor:
    """One Megatron rank. Plain class: the Ray actor is ``ray.remote(RankActor)``."""

    def __init__(self, rank: int, env: dict[str, str], sys_path: list[str]):
        self.rank = rank
        quiet.install()  # a Ray worker is a fresh interpreter, without the driver's filters
        heap.own_this_process()
        os.environ.update(env)
        os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("MEGARL_WORKER_THREADS", "1"))
        # Same import path as the driver (a shared file system is assumed across nodes).
        sys.path.extend(p for p in sys_path if p not in sys.path)

    def placement(self) -> RankPlacement:
        return RankPlacement(
            rank=self.rank,
            role=role_of(self.rank),
            node_ip=node_ip(),
            hostname=socket.gethostname(),
            node_id=ray_node_id(),
            pid=os.getpid(),
        )

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, fn: Callable[..., Any], ctx: WorkerContext, args: tuple) -> Any:
        return fn(ctx, *args)


def ray_node_id() -> str:
    with contextlib.suppress(Exception):  # outside Ray (unit tests)
        import ray

        return ray.get_runtime_context().get_node_id()
    return ""


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's; False in a driver and where Ray is not imported
    (a test may build an actor's class in its own process)."""
    ray = sys.modules.get("ray")
    return (
        ray is not None
        and ray.is_initialized()
        and ray.get_runtime_context().get_actor_id() is not None
    )


def node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return "127.0.0.1"


# ----------------------------------------------------------------------------- controller


@dataclass(frozen=True)
class SideActor:
    """An actor outside the rank group, on a bundle of its own (split placement's rollout).

    ``attach(handle, args)`` returns the ranks' args with the started actor's handle in them;
    ``cls`` has a ``placement() -> ActorPlacement`` method (where it landed, for reports).
    """

    role: str
    cls: type
    init_args: tuple
    n_gpus: int
    attach: Callable[[Any, tuple], tuple]
    max_concurrency: int = 1
    """Ray threads serving its calls (more than one: they may run at the same time)."""

    def bundle(self, device: str) -> dict[str, float]:
        return (
            {"CPU": 1.0, "GPU": float(self.n_gpus)} if device == "cuda" else {"CPU": CPU_PER_RANK}
        )


def launch_on_ray(
    fn: Callable[..., Any],
    layout: RayLayout,
    args: tuple = (),
    side: SideActor | None = None,
    watch: HeartbeatWatch | None = None,
) -> list[Any]:
    """Run ``fn(WorkerContext, *args)`` on every rank of ``layout``; return each rank's result.

    With ``watch``, each rank is told where to publish its heartbeat (a folder every node can
    write: ``run_dir`` on a shared file system) and a rank that stops is named.
    """
    import ray

    if watch is not None:
        watch.reset()
    with DeferredSignals() as signals:
        connected_here = connect()
        group, actors, side_group, side_actor = None, [], None, None
        try:
            signals.check()
            group = reserve(layout)
            if side is not None:
                side_group, side_actor = start_side_actor(side, layout.device)
                args = side.attach(side_actor, args)
            actors = start_ranks(layout, group)
            placements = ray.get([a.placement.remote() for a in actors])
            if side is not None:  # rank 0 only drives the side actor: not "actor+rollout"
                placements = [dataclasses.replace(p, role="actor") for p in placements]
            report_placements(placements)
            master_addr, master_port = rendezvous(actors[0], placements[0])
            signals.check()
            ranks = (actors, placements, fn, master_addr, master_port, args)
            return run_ranks(*ranks, watch=watch, poll=signals.check)
        finally:
            release_group(side_group)  # before `release`, which may disconnect from Ray
            release(
                actors + ([side_actor] if side_actor is not None else []),
                group,
                disconnect=connected_here,
            )
            if watch is not None:
                watch.reset()


class DeferredSignals:
    """The caller's SIGTERM/SIGINT handlers, run between Ray calls instead of inside them.

    A Python handler that raises (``stop_on_signals``'s ``RunStopped``) while the main thread is
    inside one of Ray's Cython calls (``ray.wait``, ``ray.get``, ``ray.init``) comes out as
    ``SystemError: ... returned a result with an exception set``, which would be reported as a
    rank's failure. So for this block a signal is only recorded, and :meth:`check` (called
    between start-up steps and at every poll of the run) runs the caller's handler in plain
    Python. A signal without a Python handler (``SIG_DFL``, ``SIG_IGN``) is left as it is.
    """

    def __init__(self) -> None:
        self.handlers: dict[int, Callable] = {}
        self.received: int | None = None

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handler = signal.getsignal(sig)
                if callable(handler):
                    self.handlers[sig] = handler
                    signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum

    def check(self) -> None:
        """Run the handler of a signal received since the last check (it may raise)."""
        if self.received is not None:
            signum, self.received = self.received, None
            self.handlers[signum](signum, None)

    def __exit__(self, exc_type, _exc, _tb) -> None:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        if exc_type is None:  # a signal that came during the clean-up still stops the caller
            self.check()


def connect() -> bool:
    """Join ``RAY_ADDRESS``'s cluster if set, else start a private local one: never someone
    else's by accident (a bare ``ray.init()`` joins the cluster a ``ray start`` on this machine
    recorded in /tmp/ray). False if the caller had already connected (we then leave Ray as is)."""
    import ray

    if ray.is_initialized():
        return False
    quiet = {
        "include_dashboard": False,
        "log_to_driver": True,
        "logging_level": "WARNING",
        "configure_logging": True,
    }
    if os.environ.get("RAY_ADDRESS"):
        with _keep_signal_handlers():
            ray.init(address="auto", **{k: v for k, v in quiet.items() if k != "include_dashboard"})
        return True
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for attempt in range(LOCAL_START_ATTEMPTS):
        try:
            with _keep_signal_handlers():
                ray.init(address="local", **quiet)
            ray_reaper.start()  # a private Ray's agents end with this driver, however it ends
            return True
        except Exception as exc:  # Ray waits a fixed 30 s for its raylet; an overloaded host
            ray.shutdown()  # can miss it once, so retry before giving up.
            if "timed out during startup" not in str(exc) or attempt + 1 == LOCAL_START_ATTEMPTS:
                raise
    return False  # unreachable: the last attempt returns or raises


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Put back the caller's Python SIGTERM/SIGINT handlers after ``ray.init``.

    ``ray.init`` installs its own SIGTERM handler in the driver, which exits (code 1, or 15
    when joining a cluster) past the launcher: no one-line report, no exit 143. With the
    caller's handler back (``stop_on_signals``, through :class:`DeferredSignals`), the stop
    unwinds through :func:`release`, which kills the actors and stops a private Ray. A default
    (non-Python) handler is left replaced: then Ray's own cleanup is the better one.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if callable(handler):
                signal.signal(sig, handler)


def reserve(layout: RayLayout):
    """A placement group over ``nnodes`` bundles; fails with a clear message if it cannot fit."""
    import ray
    from ray.util.placement_group import placement_group

    alive = [n for n in ray.nodes() if n.get("Alive")]
    if layout.nnodes > len(alive):
        raise PlacementError(
            f"trainer.nnodes={layout.nnodes} but the Ray cluster has {len(alive)} node(s)"
        )
    group = placement_group(layout.bundles(), strategy=layout.strategy())
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        raise PlacementError(
            f"Ray could not reserve {layout.nnodes} node(s) x {layout.bundle()} within "
            f"{RESERVE_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})"
        )
    return group


def start_side_actor(side: SideActor, device: str):
    """Reserve the side actor's own bundle and start it there; wait until it is built."""
    import ray.exceptions
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = side.bundle(device)
    group = placement_group([bundle], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        raise PlacementError(
            f"Ray could not reserve {bundle} for the {side.role} within {RESERVE_TIMEOUT_S:.0f} s"
        )
    actor = (
        ray.remote(side.cls)
        .options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            max_concurrency=side.max_concurrency,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group),
        )
        .remote(*side.init_args)
    )
    try:
        placement = ray.get(actor.placement.remote())  # also waits until it is built
    except ray.exceptions.RayActorError as exc:
        raise WorkerFailed(-1, None, _death_cause(exc), where=f"{side.role} actor") from None
    where = placement.describe()  # pyright: ignore[reportAttributeAccessIssue] (ray.get: a list)
    print(f"megarl ray: {where}", file=sys.stderr, flush=True)
    return group, actor


def start_ranks(layout: RayLayout, group) -> list:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    shell = ray.remote(RankActor)
    resources = layout.rank_resources()
    env, path = forwarded_env(), list(sys.path)
    return [
        shell.options(
            num_cpus=resources["CPU"],
            num_gpus=resources.get("GPU", 0),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=layout.node_index(rank)
            ),
        ).remote(rank, env, path)
        for rank in range(layout.world_size)
    ]


def report_placements(placements: list[RankPlacement]) -> None:
    nodes = {p.node_id for p in placements}
    print(
        f"megarl ray: {len(placements)} rank(s) on {len(nodes)} node(s): "
        + "; ".join(p.describe() for p in placements),
        file=sys.stderr,
        flush=True,
    )


def rendezvous(rank0_actor, rank0: RankPlacement) -> tuple[str, int]:
    import ray

    return rank0.node_ip, int(ray.get(rank0_actor.free_port.remote()))


def run_ranks(
    actors: list,
    placements: list[RankPlacement],
    fn: Callable,
    master_addr: str,
    master_port: int,
    args: tuple,
    watch: HeartbeatWatch | None = None,
    poll: Callable[[], None] = lambda: None,
) -> list[Any]:
    """Start every rank and wait; the first failure (death, exception, or with ``watch`` a main
    loop that stopped) ends the run. ``poll`` runs first at every poll (a stop signal comes
    before the ranks' errors, which may be its consequence). With ``watch`` the stuck-rank
    checks are the local launcher's (:func:`raise_if_stuck`): while no rank failed, one in the
    step loop without progress for the collective timeout + :data:`STALE_GRACE_S`; once one
    raised, a live rank that stopped before it (half the timeout), whose stop its error most
    likely is."""
    import ray

    world = len(actors)
    beat_dir = watch.folder if watch is not None else None
    contexts = [WorkerContext(r, world, master_addr, master_port, beat_dir) for r in range(world)]
    pending = {actor.run.remote(fn, contexts[r], args): r for r, actor in enumerate(actors)}
    results: dict[int, Any] = {}
    next_watch = time.monotonic() + WATCH_POLL_S
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        poll()
        for ref in done:
            rank = pending.pop(ref)
            results[rank] = _result_of(ref, rank, pending, placements, watch)
        if watch is not None and time.monotonic() >= next_watch:
            next_watch = time.monotonic() + WATCH_POLL_S
            # no rank failed, yet one in the step loop stopped: a collective that never times out
            live = _pids(pending.values(), placements)
            stale_s = watch.timeout_s + STALE_GRACE_S
            raise_if_stuck(watch, live, {}, stale_s, True, lambda r: placements[r].describe())
    return [results[r] for r in range(world)]


def _pids(ranks, placements: list[RankPlacement]) -> dict[int, int]:
    return {rank: placements[rank].pid for rank in ranks}


def _result_of(
    ref, rank: int, pending: dict, placements: list[RankPlacement], watch: HeartbeatWatch | None
) -> Any:
    """A finished rank's result, or the run's :class:`WorkerFailed`: the rank's own error, or
    the peer that caused it (killed, or with ``watch`` stuck: the error is then a collective that
    timed out waiting for it)."""
    import ray.exceptions

    where = placements[rank].describe()
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        during = _last_seen_during(watch, rank, placements)
        raise WorkerFailed(rank, None, _death_cause(exc) + during, where=where) from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        if isinstance(cause, SideActorFailed):  # the rollout actor, not this rank
            raise WorkerFailed(
                -1,
                None,
                cause.detail,
                where=cause.where,
                exit_code=cause.exit_code,
                traceback=getattr(cause, "traceback", ""),
            ) from None
        if isinstance(cause, MegarlError):  # e.g. a bad reward function: exit 2
            raise WorkerFailed(
                rank, None, str(cause), where=where, exit_code=cause.exit_code
            ) from None
        _raise_if_a_rank_died(pending, placements)  # the cause, not this symptom
        if isinstance(cause, SystemExit):
            if not is_reported_exit(cause):  # no rank's work ends in an exit of code 0
                raise WorkerFailed(rank, None, early_exit_line(cause), where=where) from None
            raise SystemExit(cause.code) from None
        beat = None
        error = f"{type(cause).__name__}: {cause}"
        if watch is not None:
            live, failed = _pids(pending.values(), placements), _pids([rank], placements)
            raise_if_stuck(
                watch,
                live,
                failed,
                watch.timeout_s / 2,
                where=lambda r: placements[r].describe(),
                timed_out=frozenset(failed) if is_collective_timeout(error) else frozenset(),
            )
            beat = watch.read(failed).get(rank)
        trace = str(exc)  # Ray's text of the remote traceback
        raise raised_error_report(rank, error, trace, beat, where=where) from None


def _raise_if_a_rank_died(pending: dict, placements: list[RankPlacement]) -> None:
    """A rank's Python error may be its collective noticing that a peer was killed; Ray reports
    the death a moment later. Wait ``CAUSE_GRACE_S`` for one and name the dead rank if any."""
    import ray.exceptions

    if not pending:
        return
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=CAUSE_GRACE_S)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            rank = pending[ref]
            raise WorkerFailed(
                rank,
                None,
                _death_cause(exc) + "; then other rank(s) failed",
                where=placements[rank].describe(),
            ) from None
        except ray.exceptions.RayTaskError:
            continue


def _last_seen_during(
    watch: HeartbeatWatch | None, rank: int, placements: list[RankPlacement]
) -> str:
    """`` during <phase>, while running <user call>`` from a dead rank's last heartbeat (a
    tool's ``os._exit`` or a segfault raises nothing that could name the call), or ""."""
    beat = watch.read(_pids([rank], placements)).get(rank) if watch is not None else None
    return f" during {beat.during}" if beat is not None else ""


def _death_cause(exc: BaseException) -> str:
    """Ray's actor-death text, cut to its exit type and detail (the rest is generic advice)."""
    text = " ".join(str(exc).split())
    kind = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: (.*?\.)", text)
    parts = [f"exit type {kind.group(1)}" if kind else "", detail.group(1) if detail else ""]
    summary = "; ".join(p for p in parts if p) or "no Python error"
    return f"the process died (killed, OOM or crashed: {summary})"


def release(actors: list, group, disconnect: bool = True) -> None:
    """Kill every rank, drop the placement group, disconnect if we connected (a private Ray
    stops with it; a shared cluster only loses this driver)."""
    import ray

    if not ray.is_initialized():
        return
    for actor in actors:
        with contextlib.suppress(Exception):  # already dead
            ray.kill(actor, no_restart=True)
    _wait_until_dead(actors)
    release_group(group)
    if disconnect:
        ray.shutdown(wait_for_processes=True)
        ray_reaper.stop()  # Ray's processes are gone: nothing is left for it to end


def _wait_until_dead(actors: list) -> None:
    """Wait (at most :data:`KILL_WAIT_S`) until Ray reports each killed actor dead: a call to it
    then fails. ``ray.kill`` only asks; without this a run stopped on a shared cluster could
    report its ranks stopped while they still run."""
    import ray

    probes = []
    for actor in actors:
        with contextlib.suppress(Exception):
            probes.append(actor.__ray_ready__.remote())
    if probes:
        with contextlib.suppress(Exception):
            ray.wait(probes, num_returns=len(probes), timeout=KILL_WAIT_S)


def release_group(group) -> None:
    import ray

    if group is None or not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    with contextlib.suppress(Exception):  # cluster already gone
        remove_placement_group(group)

"""Running a step's agent loops against one rollout engine: batching, seeds, partial rollouts.

Every trajectory of a step runs as its own task on one asyncio event loop
(:func:`run_agent_loops`, callable from the synchronous rollout producer). A loop's
``await ctx.generate(...)`` does not call the engine itself: it queues a
:class:`~megarl.engines.base.Request` and waits. Queued requests of all trajectories go to the
engine together in one ``generate_requests`` call, run in a worker thread
(:func:`asyncio.to_thread`) so that tool calls keep running meanwhile; one engine call at a time.

**Flush policy.** The queue is sent when no engine call is in flight and every trajectory that
is still running is either waiting on a generate call or busy outside the engine (inside
``with ctx.busy():``, which the tool loop puts around its tool calls). A trajectory that is
doing anything else -- between two awaits, or awaiting something it did not mark busy -- is
waited for, since its next turn may be about to join the batch. So the first turns of a step go
in one call, in sample order, exactly as the plain ``engine.generate`` sends them; later turns
of trajectories that come back from their tools together share a call; and a slow tool holds
back only its own trajectory. One refinement: when the queue is ready while trajectories are
busy, it waits up to ``linger_s`` (default 50 ms) for them to come back and queue their turns
too, so that tools that take milliseconds do not split a turn's batch into a call per
trajectory (each of which would cost a whole engine call); a tool that takes longer than that is
not waited for. Timing changes only which requests share a call, never what they sample (see
Seeds). Requests whose sampling overrides differ (temperature, top-p) go in separate calls,
one after the other; requests that differ only in ``max_new_tokens`` share a call, each
carrying its own limit (:attr:`~megarl.engines.base.Request.max_new_tokens`), so each stops at
its own (the HF engine drops a row from the batch once it has). That is exact -- a request's
first ``k`` tokens come from its own seed (:func:`megarl.engines.base.token_seed`) and do not
depend on its limit.

**Seeds.** Deterministic whatever the timing or the batching: call ``t`` (``t = 0, 1, ...``, in
the order the trajectory makes them) of sample ``i`` is seeded :func:`turn_seed` ``(seed_i, t)``
with ``seed_i = request_seed(step seed, i)`` (:func:`make_samples`), and turn 0 is seeded
``seed_i`` itself, as the plain ``engine.generate`` seeds prompt ``i``; so ``single_turn`` is
bitwise the plain rollout. Since the HF engine's responses do not depend on which requests
share a call, a trajectory is reproducible from (weights, sample, seed).

**Partial rollouts** (asynchronous training, ``async_training.partial_rollout``). Newer weights
interrupt the engine call in flight; the batcher has them loaded and resumes the interrupted
responses from their tokens so far (:class:`PartialRollouts`). A turn may then hold tokens of
two policy versions, and its output says which sampled each (``GenerateOutput.versions``, kept
by the trajectory for the staleness gates). The HF engine continues each response's own seeded
stream, so a turn interrupted and resumed under unchanged weights is the uninterrupted turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from megarl.agent.loop import AgentLoop, LoopFor, Sample
from megarl.agent.metrics import counter_metrics, trajectory_metrics
from megarl.agent.metrics import (  # importable from here too, where callers look for it
    validation_trajectory_metrics as validation_trajectory_metrics,
)
from megarl.agent.trajectory import GenerateOutput, Trajectory
from megarl.engines.base import (
    Generation,
    Request,
    RolloutEngine,
    SamplingParams,
    join_pieces,
    request_seed,
)
from megarl.user_code import current_user_call, user_call

_MAX_SEED = 2**63 - 1

LINGER_S = 0.05
"""How long a ready batch waits for busy trajectories (see the flush policy)."""

OVERRIDES: tuple[str, ...] = ("temperature", "top_p", "max_new_tokens")
"""The sampling settings a loop may override per ``ctx.generate`` call (not the seed: seeds
follow :func:`turn_seed`, so that trajectories stay reproducible)."""


def turn_seed(sample_seed: int, turn: int) -> int:
    """The request seed of generate call ``turn`` of a sample seeded ``sample_seed``: the sample
    seed itself for turn 0 (the plain rollout's), a hash of both for later turns."""
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


def make_samples(
    prompt_ids: Sequence[Sequence[int]],
    rows: Sequence[Mapping[str, Any]] | None = None,
    seed: int = 0,
    messages: Sequence[Sequence[Mapping[str, Any]]] | None = None,
) -> list[Sample]:
    """One :class:`Sample` per prompt, sample ``i`` seeded ``request_seed(seed, i)`` (``seed``:
    the step's sampling seed, as ``SamplingParams.seed`` for ``engine.generate``)."""
    count = len(prompt_ids)
    for what, values in (("rows", rows), ("messages", messages)):
        if values is not None and len(values) != count:
            raise ValueError(f"{count} prompts but {len(values)} {what}")
    return [
        Sample(
            index=i,
            prompt_ids=tuple(ids),
            row=rows[i] if rows is not None else {},
            seed=request_seed(seed, i),
            messages=tuple(messages[i]) if messages is not None else (),
        )
        for i, ids in enumerate(prompt_ids)
    ]


def finish_reason(generation: Generation) -> str:
    """``stop`` (ended on an EOS token), ``abort`` (interrupted) or ``length``."""
    if generation.finished:
        return "stop"
    return "abort" if generation.interrupted else "length"


def generate_output(
    generation: Generation, limit: int, versions: Sequence[int] | None = None
) -> GenerateOutput:
    """``generation`` as a loop sees it, cut to the request's own ``max_new_tokens`` (an engine
    that ignored the request's limit may have sampled more for it); ``versions``: the policy
    version of each token (partial rollouts), cut alike."""
    cut = len(generation.response_ids) > limit
    return GenerateOutput(
        generation.response_ids[:limit],
        generation.response_logprobs[:limit],
        "length" if cut else finish_reason(generation),
        None if versions is None else tuple(versions[:limit]),
    )


@dataclass(frozen=True)
class PartialRollouts:
    """Newer weights may interrupt an engine call (``async_training.partial_rollout``).

    A trajectory's loop cannot be suspended across a weight update, so the update happens
    inside it: the engine call comes back with the responses so far, the batcher has the newer
    weights loaded (the engine is idle between its two calls) and resumes each response from
    its tokens so far -- the loop receives one output whose tokens carry the version that
    sampled each. Turns that start later run under the newer weights."""

    interrupt: threading.Event
    """Set when newer weights are ready; an engine call then returns what it sampled so far."""
    serving: Callable[[], int]
    """The policy version the engine serves now."""
    take_newer: Callable[[], None]
    """Load the newer weights into the engine and clear ``interrupt`` (called between two
    engine calls)."""


# --- the batcher ----------------------------------------------------------------------------


@dataclass
class _Slot:
    """One trajectory's standing with the batcher."""

    waiting: int = 0
    """Its generate calls not answered yet (queued or in the engine)."""
    busy: int = 0
    """Depth of ``ctx.busy()`` blocks it is in."""
    done: bool = False

    @property
    def running(self) -> bool:
        """Neither waiting, nor busy, nor done: the flush waits for it."""
        return not self.done and not self.waiting and not self.busy


@dataclass(eq=False)
class _Pending:
    """One queued ``ctx.generate`` call (compared by identity)."""

    slot: int
    turn: int
    request: Request
    params: SamplingParams
    """The call's own sampling (its ``max_new_tokens`` is its limit)."""
    future: asyncio.Future[GenerateOutput]
    answered: bool = False


class _Batcher:
    """Queues the trajectories' generate calls and sends them per the flush policy."""

    def __init__(
        self,
        engine: RolloutEngine,
        params: SamplingParams,
        count: int,
        linger_s: float,
        partial: PartialRollouts | None = None,
    ) -> None:
        self.engine, self.params, self.linger_s = engine, params, linger_s
        self.partial = partial
        self.slots = [_Slot() for _ in range(count)]
        self.changed = asyncio.Event()
        """Set on every change of a trajectory's standing (for the linger)."""
        self.pending: list[_Pending] = []
        self.in_flight = False
        self.closed = False
        self.flush_task: asyncio.Task[None] | None = None
        self.engine_calls = 0
        self.engine_requests = 0
        self.engine_seconds = 0.0

    # --- trajectory state --------------------------------------------------------------------

    def change(self, index: int, waiting: int = 0, busy: int = 0, done: bool = False) -> None:
        """Update trajectory ``index``'s standing, then flush if the policy says so."""
        self._update(index, waiting, busy, done)
        self._maybe_flush()

    def _update(self, index: int, waiting: int = 0, busy: int = 0, done: bool = False) -> None:
        slot = self.slots[index]
        slot.waiting += waiting
        slot.busy += busy
        slot.done = slot.done or done
        self.changed.set()

    @property
    def running(self) -> int:
        """Trajectories the flush waits for (see :attr:`_Slot.running`)."""
        return sum(slot.running for slot in self.slots)

    @property
    def busy(self) -> int:
        """Trajectories inside ``ctx.busy()`` (not done)."""
        return sum(slot.busy > 0 and not slot.done for slot in self.slots)

    async def submit(
        self, index: int, turn: int, request: Request, params: SamplingParams
    ) -> GenerateOutput:
        future: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
        pending = _Pending(index, turn, request, params, future)
        self.pending.append(pending)
        try:
            self.change(index, waiting=1)
            return await future
        except asyncio.CancelledError:
            if pending in self.pending:  # cancelled before it was sent
                self.pending.remove(pending)
                self.change(index, waiting=-1)
            raise

    # --- flushing ----------------------------------------------------------------------------

    def _maybe_flush(self) -> None:
        if self.closed or self.in_flight or not self.pending or self.running:
            return
        self.in_flight = True
        # a context of its own: the engine call is the rollout's, not the user call of the
        # trajectory whose change started the flush (see _DaemonThreads)
        self.flush_task = asyncio.get_running_loop().create_task(
            self._flush(), context=contextvars.Context()
        )

    async def _linger(self) -> None:
        """Wait up to ``linger_s`` while trajectories are busy (or just back from being busy,
        about to queue their turn), so that fast tools' trajectories join the call."""
        deadline = time.monotonic() + self.linger_s
        while (self.busy or self.running) and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _flush(self) -> None:
        """Linger, then send the queue; whatever fails is handed to the callers waiting on it
        (never left waiting), and the next flush is considered."""
        batch: list[_Pending] = []
        try:
            await self._linger()
            batch, self.pending = self.pending, []
            await self._send(batch)
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
            for pending in batch:
                self._answer(pending, exc)
        finally:
            self.in_flight = False
            self._maybe_flush()

    async def _send(self, batch: Sequence[_Pending]) -> None:
        """One engine call per sampling group; each group's callers are answered as soon as
        its call returns, so they go on while the next group samples."""
        for params, group in _groups(batch, self.params):
            requests = [_own_limit(p, params) for p in group]
            generations, versions = await asyncio.to_thread(self._sample, requests, params)
            self.engine_calls += 1
            self.engine_requests += len(group)
            for pending, generation, tokens_versions in zip(
                group, generations, versions, strict=True
            ):
                self._answer(pending, generation, tokens_versions)

    def _sample(
        self, requests: Sequence[Request], params: SamplingParams
    ) -> tuple[list[Generation], list[tuple[int, ...] | None]]:
        """One group's requests sampled to their end (in the worker thread), with each token's
        policy version under partial rollouts (None otherwise): a response that newer weights
        interrupted goes on from its tokens so far once they are loaded (:class:`PartialRollouts`)."""
        partial = self.partial
        started = time.perf_counter()
        if partial is None:
            generations = self._engine_call(requests, params, None)
            self.engine_seconds += time.perf_counter() - started
            return generations, [None] * len(requests)
        pieces: list[list[Generation]] = [[] for _ in requests]
        versions: list[list[int]] = [[] for _ in requests]
        current, todo = list(requests), list(range(len(requests)))
        while todo:
            version = partial.serving()
            out = self._engine_call([current[i] for i in todo], params, partial.interrupt)
            resumed = []
            for i, piece in zip(todo, out, strict=True):
                pieces[i].append(piece)
                versions[i].extend([version] * len(piece.response_ids))
                if piece.interrupted:
                    current[i] = replace(
                        current[i], generated_ids=current[i].generated_ids + piece.response_ids
                    )
                    resumed.append(i)
            if resumed:
                updating = time.perf_counter()
                partial.take_newer()
                started += time.perf_counter() - updating  # the load is not generation time
            todo = resumed
        self.engine_seconds += time.perf_counter() - started
        return [join_pieces(p) for p in pieces], [tuple(v) for v in versions]

    def _engine_call(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: threading.Event | None,
    ) -> list[Generation]:
        generations = self.engine.generate_requests(requests, params, interrupt)
        if len(generations) != len(requests):
            raise RuntimeError(
                f"the engine returned {len(generations)} generations for {len(requests)} requests"
            )
        return generations

    def _answer(
        self,
        pending: _Pending,
        result: Generation | BaseException,
        versions: Sequence[int] | None = None,
    ) -> None:
        """Resolve one caller (once); it counts as running from here, before its task resumes,
        so the next flush waits for its next turn."""
        if pending.answered:
            return
        pending.answered = True
        self._update(pending.slot, waiting=-1)
        if pending.future.done():  # its trajectory was cancelled meanwhile
            return
        if isinstance(result, BaseException):
            pending.future.set_exception(result)
            return
        try:
            output = generate_output(result, pending.params.max_new_tokens, versions)
        except ValueError as exc:  # an engine output a trajectory refuses (e.g. NaN logprobs)
            pending.future.set_exception(exc)
            return
        pending.future.set_result(output)

    async def close(self) -> None:
        """No more calls; wait for (or cancel, after a failure) the one in flight."""
        self.closed = True
        task = self.flush_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _own_limit(pending: _Pending, sent: SamplingParams) -> Request:
    """The request as sent in a call at ``sent``: carrying its own ``max_new_tokens`` where that
    is not the call's, so the engine stops it there."""
    limit = pending.params.max_new_tokens
    return (
        pending.request
        if limit == sent.max_new_tokens
        else replace(pending.request, max_new_tokens=limit)
    )


def _groups(
    batch: Sequence[_Pending], base: SamplingParams
) -> list[tuple[SamplingParams, list[_Pending]]]:
    """The batch split by (temperature, top_p), each group in (sample, turn) order and sent
    with the largest ``max_new_tokens`` of its requests (each request carries its own);
    groups in order of their first request. A group of plain ``ctx.generate`` calls is sent
    with ``base`` itself."""
    ordered = sorted(batch, key=lambda p: (p.slot, p.turn))
    grouped: dict[tuple[float, float], list[_Pending]] = {}
    for pending in ordered:
        grouped.setdefault((pending.params.temperature, pending.params.top_p), []).append(pending)
    out = []
    for (temperature, top_p), group in grouped.items():
        limit = max(p.params.max_new_tokens for p in group)
        params = replace(base, temperature=temperature, top_p=top_p, max_new_tokens=limit)
        out.append((params, group))
    return out


# --- what a loop is given -------------------------------------------------------------------


class AgentContext:
    """One trajectory's handle on the step: sample turns, mark tool time, count events.

    ``tokenizer`` is the model's; ``max_response_tokens`` the response budget
    (``rollout.max_new_tokens``, what a :class:`Trajectory` built with it enforces);
    ``params`` the step's sampling."""

    def __init__(
        self,
        batcher: _Batcher,
        index: int,
        sample: Sample,
        tokenizer: Any,
        params: SamplingParams,
    ) -> None:
        self._batcher, self._index = batcher, index
        self.sample = sample
        self.tokenizer = tokenizer
        self.params = params
        self.max_response_tokens = params.max_new_tokens
        self.counters: dict[str, float] = {}
        """What the loop counted (:meth:`count`), summed over the step as ``agent/<name>``."""
        self.generate_calls = 0

    async def generate(self, token_ids: Sequence[int], **overrides: Any) -> GenerateOutput:
        """Sample one turn continuing ``token_ids`` (prompt and response so far).

        ``overrides``: ``temperature``, ``top_p``, ``max_new_tokens`` (None: the step's). The
        call is seeded :func:`turn_seed` ``(sample.seed, n)`` for the trajectory's ``n``-th
        call and batched with the other trajectories' (see the module docstring)."""
        params = _with_overrides(self.params, overrides)
        turn = self.generate_calls
        self.generate_calls += 1
        request = Request(tuple(int(t) for t in token_ids), turn_seed(self.sample.seed, turn))
        return await self._batcher.submit(self._index, turn, request, params)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Marks this trajectory busy outside the engine (tool calls, an environment step):
        the other trajectories' queued turns are sent without waiting for it."""
        self._batcher.change(self._index, busy=1)
        try:
            yield
        finally:
            self._batcher.change(self._index, busy=-1)

    def count(self, name: str, value: float = 1.0) -> None:
        """Add ``value`` to this trajectory's counter ``name`` (reported as ``agent/<name>``)."""
        self.counters[name] = self.counters.get(name, 0.0) + value


def _with_overrides(params: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise TypeError(
            f"ctx.generate: unknown sampling override {unknown[0]!r} "
            f"(overridable: {', '.join(OVERRIDES)})"
        )
    given = {key: value for key, value in overrides.items() if value is not None}
    return replace(params, **given) if given else params


# --- running a step -------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentResult:
    """A step's trajectories in sample order, and its ``agent/*`` metrics (times included)."""

    trajectories: list[Trajectory]
    """Each sample's trajectory (its first branch, where a loop returned several)."""
    metrics: dict[str, float]
    branches: list[list[Trajectory]] = field(default_factory=list)
    """Each sample's further branches beyond the first (empty lists for most loops); each
    trains as a sequence of its own with the sample's reward and advantage."""


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """A step's default executor (``asyncio.to_thread``, ``run_in_executor(None, ...)``: the
    engine calls and the tools' blocking work): each call in a daemon thread of its own, never
    joined. ``asyncio.run`` joins its default executor's threads at the end, and Python joins a
    plain pool's at exit, so one tool thread that never returns (its call long since timed out)
    would hold the step, and the process, forever; a daemon thread is left running instead
    (Python cannot stop a thread; it ends with the process) and counted
    (:meth:`abandoned`)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)  # the pool itself is never used
        self._calls: list[tuple[concurrent.futures.Future[Any], str]] = []
        self._calls_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        what = current_user_call() or "the rollout"

        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)

        with self._calls_lock:
            self._calls = [(f, w) for f, w in self._calls if not f.done()]
            self._calls.append((future, what))
        threading.Thread(target=work, name="megarl-agent-call", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)  # never joins a call

    def abandoned(self) -> list[str]:
        """The user calls whose worker threads are still running (their callers gave up)."""
        with self._calls_lock:
            return [what for future, what in self._calls if not future.done()]


def run_agent_loops(
    engine: RolloutEngine,
    loop: AgentLoop | LoopFor,
    samples: Sequence[Sample],
    params: SamplingParams,
    tokenizer: Any,
    linger_s: float = LINGER_S,
    partial: PartialRollouts | None = None,
) -> AgentResult:
    """Every sample's trajectory, built concurrently on an event loop of its own (see the
    module docstring). ``loop``: one loop for all samples, or the loop of each
    (:class:`megarl.agent.loop.LoopChooser`). ``params``: the step's sampling (its
    ``max_new_tokens`` is each trajectory's response budget, ``ctx.max_response_tokens``).
    ``partial``: newer weights may interrupt the engine calls (the trajectories' tokens then
    carry their versions). Worker threads (the tools' ``asyncio.to_thread``) are daemon
    threads that the step does not wait for (:class:`_DaemonThreads`): a tool's blocking work
    that outlives its timeout is left running, warned about and counted in
    ``agent/abandoned_threads``. A loop that raises stops the step: the other trajectories are
    cancelled (their tools released) and the exception is raised here (a ``SystemExit`` or
    ``KeyboardInterrupt`` as :class:`megarl.user_code.UserCodeExit`, naming loop and sample:
    never the process's exit)."""
    threads = _DaemonThreads()
    choose = (lambda _sample: loop) if isinstance(loop, AgentLoop) else loop

    async def on_daemon_threads() -> AgentResult:
        asyncio.get_running_loop().set_default_executor(threads)
        started = time.perf_counter()
        loops = [choose(sample) for sample in samples]
        batcher = _Batcher(engine, params, len(samples), linger_s, partial)
        contexts = [
            AgentContext(batcher, i, sample, tokenizer, params) for i, sample in enumerate(samples)
        ]
        result = await _drive(batcher, loops, contexts)
        result.metrics["agent/timing_s/loops"] = time.perf_counter() - started
        return result

    result = asyncio.run(on_daemon_threads())
    abandoned = threads.abandoned()
    result.metrics["agent/abandoned_threads"] = float(len(abandoned))
    if abandoned:
        warnings.warn(
            f"{len(abandoned)} worker thread(s) still running after their calls timed out "
            f"({', '.join(sorted(set(abandoned)))}): left behind as daemon threads, which end "
            "with the process (agent/abandoned_threads counts them per step)",
            stacklevel=2,
        )
    return result


async def _drive(
    batcher: _Batcher, loops: Sequence[AgentLoop], contexts: Sequence[AgentContext]
) -> AgentResult:
    """Sample ``i``'s trajectories from ``loops[i]`` with ``contexts[i]``, all at once; the
    batcher closed at the end, whatever happened."""
    tasks = [
        asyncio.create_task(_run_one(batcher, i, loop, ctx))
        for i, (loop, ctx) in enumerate(zip(loops, contexts, strict=True))
    ]
    try:
        await _all_or_first_error(tasks)
    finally:
        await batcher.close()
    trajectories = [task.result()[0] for task in tasks]
    branches = [task.result()[1:] for task in tasks]
    return AgentResult(trajectories, agent_metrics(trajectories, contexts, batcher), branches)


async def _run_one(
    batcher: _Batcher, index: int, loop: AgentLoop, ctx: AgentContext
) -> list[Trajectory]:
    """``ctx.sample``'s trajectories (one, or a loop's branches: at least one)."""
    sample = ctx.sample
    try:
        name = f"agent loop {type(loop).__name__}: run (sample {sample.index})"
        with user_call(name, record=False):  # it mostly waits on the engine: not listed
            returned = await loop.run(sample, ctx)
    finally:
        batcher.change(index, done=True)
    found = [returned] if isinstance(returned, Trajectory) else returned
    if (
        not isinstance(found, list)
        or not found
        or not all(isinstance(t, Trajectory) for t in found)
    ):
        raise TypeError(
            f"{type(loop).__name__}.run returned a {type(returned).__name__} for sample "
            f"{sample.index}, not a Trajectory (or a non-empty list of them)"
        )
    return found


async def _all_or_first_error(tasks: Sequence[asyncio.Task[list[Trajectory]]]) -> None:
    """Wait for every task; on the first failure cancel the others (their ``finally`` blocks
    run) and raise the failure of the lowest sample index."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failures = [t.exception() for t in tasks if t.done() and not t.cancelled()]
    first = next((exc for exc in failures if exc is not None), None)
    if first is None:
        return
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    raise first


def agent_metrics(
    trajectories: Sequence[Trajectory], contexts: Sequence[AgentContext], batcher: _Batcher
) -> dict[str, float]:
    """Per step: turns, tool use, observation length, engine calls and time, loop counters."""
    calls = max(1, batcher.engine_calls)
    metrics = {
        **trajectory_metrics(trajectories, batcher.params.max_new_tokens),
        "agent/engine_calls": float(batcher.engine_calls),
        "agent/requests_per_engine_call/mean": batcher.engine_requests / calls,
        "agent/timing_s/gen": batcher.engine_seconds,
        "agent/timing_s/gen_per_call": batcher.engine_seconds / calls,
    }
    metrics.update(counter_metrics([ctx.counters for ctx in contexts]))
    return metrics

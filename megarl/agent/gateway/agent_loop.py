"""``rollout.agent.loop=openai``: an unmodified agent, called once per sample, talking to the
policy through the gateway.

The user's function (``rollout.agent.entrypoint=package.module:function``) is
``solve(row, llm)``, ``async def`` or plain ``def``: ``row`` is the dataset row (verl's schema,
``row["prompt"]`` the chat messages), ``llm`` an :class:`LLMEndpoint` (a base URL of the
sample's own session, the run's API key, the model name). It returns the reward (a number, or
anything :func:`megarl.data.rewards.reward_value` accepts), or None to let the dataset's reward
score the session's last answer.

How it is run, and why:

* **In a thread of its own**, with an event loop of its own for an ``async def``. The agent's
  code never runs on the step's event loop (where the batcher lives), so an agent that blocks
  (a synchronous SDK inside an ``async def``, a slow tool) holds only itself.
* **Bounded**: ``rollout.agent.gateway.session_timeout_s`` of wall clock. Past it the session is
  closed (later requests get 410) and the thread is abandoned (a daemon: Python cannot stop a
  thread, and the process's exit does not wait for it). A hung agent never hangs the step.
* **Failures are the sample's**: an exception the agent raises (``SystemExit`` included), a
  timeout, or a return value that is not a reward is handled by ``data.reward_error``: ``raise``
  stops the run with one line naming the sample and the exception; ``zero`` scores the sample 0
  (its branches still train on what was sampled), counts it in ``agent/gateway/agent_errors``
  and warns once.
* **Batching**: a session counts as busy outside the engine (:meth:`AgentContext.busy`) from its
  first answer on, except while a request of it waits for the engine; before its first
  request the batcher waits for it, so every agent's first turn shares one engine call, as the
  plain rollout's prompts do.

What trains: every branch of the session (:mod:`megarl.agent.gateway.sessions`) is a sequence
of the step, all with the session's reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megarl.agent.gateway.protocol import ChatRequest
from megarl.agent.gateway.server import GatewayServer
from megarl.agent.gateway.sessions import Session, tools_key
from megarl.agent.loop import AgentLoop, AgentLoopError, Sample
from megarl.agent.render import ChatRenderer
from megarl.agent.trajectory import GenerateOutput, Trajectory
from megarl.data.rewards import reward_value
from megarl.errors import BadInputError, RunAborted
from megarl.user_code import UserCodeExit, describe_user_exception, user_call

if TYPE_CHECKING:
    from megarl.agent.driver import AgentContext

ENTRYPOINT_KEY = "rollout.agent.entrypoint"

FIRST_REQUEST_WAIT_S = 2.0
"""How long the batcher waits for a session's first request before sending the other
sessions' first turns without it (agents start their first request within milliseconds; one
that prepares longer only misses the first shared engine call)."""


class AgentFailedError(BadInputError):
    """The user's agent failed on a sample under ``data.reward_error=raise``: one line."""


@dataclass(frozen=True)
class LLMEndpoint:
    """What an agent is given to reach the policy: one sample's session."""

    base_url: str
    """OpenAI-style base, ending in ``/v1`` (``openai.OpenAI(base_url=...)``)."""
    api_key: str
    model: str
    """The name to pass as ``model``."""
    anthropic_base_url: str
    """The same session for the ``anthropic`` SDK's ``base_url`` (it adds ``/v1/messages``)."""
    session_id: str


def resolve_entrypoint(path: str | None, key: str = ENTRYPOINT_KEY) -> Callable[..., Any]:
    """The function ``package.module:function`` (or ``path/to/file.py:function``) names; a
    one-line error naming ``key`` otherwise."""
    if not path or not isinstance(path, str):
        raise AgentLoopError(
            f"{key} is not set: rollout.agent.loop=openai calls your agent, "
            "'package.module:function' (async def solve(row, llm))"
        )
    module_name, sep, attribute = path.rpartition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise AgentLoopError(
            f"{key}={path!r}: expected 'package.module:function' or 'path/to/file.py:function'"
        )
    try:
        module = _import_module_or_file(module_name)
    except ModuleNotFoundError as exc:
        raise AgentLoopError(
            f"{key}={path!r}: module {exc.name or module_name!r} not found"
        ) from None
    except BaseException as exc:
        if isinstance(exc, RunAborted | KeyboardInterrupt):
            raise
        raise AgentLoopError(
            f"{key}={path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise AgentLoopError(
            f"{key}={path!r}: module {module_name!r} has no function {attribute!r}"
        )
    return function


def _import_module_or_file(name: str) -> ModuleType:
    """``name`` imported as a module, or, ending in ``.py``, loaded from that file (relative to
    the working directory), so an agent needs no package or ``PYTHONPATH``."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).resolve()
    if not path.is_file():
        raise ModuleNotFoundError(f"no file {name}", name=name)
    spec = importlib.util.spec_from_file_location(f"megarl_agent_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_in_thread(
    solve: Callable[..., Any], row: Mapping[str, Any], llm: LLMEndpoint, what: str
) -> concurrent.futures.Future[Any]:
    """``solve(row, llm)`` on a daemon thread (its own event loop for a coroutine), as a call
    into user code (:func:`megarl.user_code.user_call`: ``SystemExit`` and ``os._exit`` are its
    failure, not the process's); every outcome lands in the future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        try:
            with user_call(what, record=False):  # it mostly waits on the engine: not listed
                result = solve(row, llm)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            future.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(exc)

    threading.Thread(target=target, name="megarl-agent", daemon=True).start()
    return future


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class GatewayLoop(AgentLoop):
    """Runs the user's agent against a session of the gateway (see the module docstring)."""

    def setup(self) -> None:
        if self.tokenizer is None:
            raise ValueError("GatewayLoop needs the tokenizer (it renders the agent's messages)")
        self.solve = resolve_entrypoint(self.settings.entrypoint)
        self.renderer = ChatRenderer(self.tokenizer, tool_format=self.settings.tool_format)
        self._renderers: dict[str, ChatRenderer] = {tools_key(()): self.renderer}
        self._server: GatewayServer | None = None
        self._warned: set[str] = set()

    # --- the run's server ---------------------------------------------------------------------

    @property
    def server(self) -> GatewayServer:
        """Started on first use, so building the loop for start-up checks binds nothing."""
        if self._server is None:
            gateway = self.settings.gateway
            self._server = GatewayServer(gateway.host, gateway.port).start()
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def renderer_for(self, tools: Sequence[Mapping[str, Any]]) -> ChatRenderer:
        key = tools_key(tools)
        renderer = self._renderers.get(key)
        if renderer is None:
            renderer = ChatRenderer(self.tokenizer, tools, tool_format=self.settings.tool_format)
            self._renderers[key] = renderer
        return renderer

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt as the gateway renders a first request of exactly these messages (what
        start-up's context check measures; the agent may send more)."""
        return self.renderer.prompt_ids(messages)

    # --- one sample -----------------------------------------------------------------------------

    async def run(self, sample: Sample, ctx: AgentContext) -> list[Trajectory]:  # type: ignore[override]
        busy = _BusyOutsideEngine(ctx)
        # an agent slow to send its first request stops holding back the others' first turns
        first_wait = asyncio.get_running_loop().call_later(FIRST_REQUEST_WAIT_S, busy.stop_waiting)

        async def generate(ids: Sequence[int], limit: int, _: ChatRequest) -> GenerateOutput:
            with busy.waiting():
                return await ctx.generate(ids, max_new_tokens=limit)

        session = Session(
            generate,
            self.renderer_for,
            ctx.max_response_tokens,
            self.settings.max_turns,
            self.run_facts.max_prompt_tokens,
        )
        server = self.server
        session_id = server.register(session, asyncio.get_running_loop())
        base = server.session_url(session_id)
        llm = LLMEndpoint(f"{base}/v1", server.api_key, server.model_name, base, session_id)
        row = dict(sample.row)
        if sample.messages:
            row["prompt"] = [dict(m) for m in sample.messages]
        try:
            reward, failure = await self._call_agent(row, llm, sample.index)
        finally:
            first_wait.cancel()
            session.close()
            server.unregister(session_id)
            busy.close()
        if session.failure is not None:
            raise session.failure
        self._count(ctx, session, failure)
        if failure is not None:
            self._fail(sample, failure)
            reward = 0.0
        return self._trajectories(sample, ctx, session, reward)

    async def _call_agent(
        self, row: Mapping[str, Any], llm: LLMEndpoint, index: int
    ) -> tuple[float | None, str | None]:
        """The agent's reward (None: the dataset's) and its failure in words (None: none)."""
        what = f"{ENTRYPOINT_KEY}={self.settings.entrypoint} (sample {index})"
        future = _run_in_thread(self.solve, row, llm, what)
        timeout = self.settings.gateway.session_timeout_s
        try:
            returned = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            return None, (
                f"did not finish within rollout.agent.gateway.session_timeout_s={timeout:g} s"
            )
        except (RunAborted, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - the agent's failure (SystemExit arrives wrapped)
            cause = exc.cause if isinstance(exc, UserCodeExit) else exc
            return None, f"raised {describe_user_exception(cause)}"
        if returned is None:
            return None, None
        try:
            return reward_value(returned), None
        except ValueError as exc:
            return None, f"returned {exc} (expected a reward or None)"

    def _fail(self, sample: Sample, failure: str) -> None:
        """A failed sample: the run stops (``data.reward_error=raise``) or it scores 0."""
        message = f"{ENTRYPOINT_KEY}={self.settings.entrypoint}: sample {sample.index} {failure}"
        if self.run_facts.reward_error == "raise":
            raise AgentFailedError(
                f"{message}; fix the agent, or set data.reward_error=zero to score such samples 0"
            )
        self._warn_once(
            "failure",
            f"{message}; scored 0 (data.reward_error=zero; agent/gateway/agent_errors counts "
            "them per step)",
        )

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, stacklevel=2)

    @staticmethod
    def _count(ctx: AgentContext, session: Session, failure: str | None) -> None:
        stats = session.stats
        ctx.count("gateway/requests", stats.requests)
        ctx.count("gateway/errors", stats.errors)
        ctx.count("gateway/stream_requests", stats.stream_requests)
        ctx.count("gateway/latency_s", stats.latency_s)
        ctx.count("gateway/forks", stats.forks)
        ctx.count("prefix_breaks", stats.prefix_breaks)
        ctx.count("gateway/agent_errors", failure is not None)
        ctx.count("branches", len(session.trajectories()))

    def _trajectories(
        self, sample: Sample, ctx: AgentContext, session: Session, reward: float | None
    ) -> list[Trajectory]:
        """Every branch, each with the session's reward and the text the dataset's reward
        reads; a session that sampled nothing is one untrained placeholder (the prompt and an
        end-of-turn token read as an observation: no token of it trains)."""
        branches = session.trajectories()
        if not branches:
            self._warn_once(
                "empty",
                f"sample {sample.index}: the agent made no request to the gateway; the sample "
                "trains nothing (an untrained placeholder)",
            )
            placeholder = Trajectory(sample.prompt_ids, ctx.max_response_tokens)
            placeholder.add_observation([self.renderer.end_of_turn_id])
            branches = [placeholder]
        answer = session.last_reply.content if session.last_reply is not None else ""
        for trajectory in branches:
            trajectory.reward = reward
            trajectory.answer_text = answer
        return branches


class _BusyOutsideEngine:
    """The session's standing with the batcher: running (waited for) until its first request,
    then busy outside the engine except while a request of it waits for the engine."""

    def __init__(self, ctx: AgentContext) -> None:
        self._ctx = ctx
        self._busy: AbstractContextManager[None] | None = None
        self._started = False

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a request's engine call: not busy while it waits, busy once answered."""
        self.close()
        self._started = True
        try:
            yield
        finally:
            self.idle()

    def stop_waiting(self) -> None:
        """The first-request wait is over: busy, unless a request already came."""
        if not self._started:
            self.idle()

    def idle(self) -> None:
        """Busy outside the engine from now on (until the next request)."""
        if self._busy is None:
            self._busy = self._ctx.busy()
            self._busy.__enter__()

    def close(self) -> None:
        busy, self._busy = self._busy, None
        if busy is not None:
            busy.__exit__(None, None, None)

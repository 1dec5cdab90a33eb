"""Agent loops: how one sample's trajectory is built from ``ctx.generate`` calls and tools.

A loop is user code with one method, ``async def run(self, sample, ctx) -> Trajectory``. It is
given the sample (its rendered prompt ids, its dataset row, its seed) and a context
(:class:`megarl.agent.driver.AgentContext`) whose ``await ctx.generate(token_ids, ...)`` samples
one turn. Everything is token-in/token-out: the loop appends the ids the engine sampled
(:meth:`Trajectory.add_generated`) and the ids of what the environment answered
(:meth:`Trajectory.add_observation`), never a re-encoding of generated text.

Why ``async``: a step runs all its trajectories at once on one event loop
(:mod:`megarl.agent.driver`), so that every trajectory's pending turn goes to the engine in one
batched call while other trajectories wait on their tools. A loop therefore must not block the
event loop: a tool that does blocking work runs it in a thread or a subprocess.

Built in (``rollout.agent.loop``, or a dataset row's verl ``agent_name``):

* ``single_turn`` (:class:`SingleTurnLoop`): one generate call; a step produces exactly the
  tokens and logprobs of the trainer's plain ``engine.generate``.
* ``tool`` (:class:`ToolAgentLoop`): generate, run the turn's tool calls, show the results,
  generate again, until the model answers without calling a tool.
* ``package.module:ClassName``: a user's :class:`AgentLoop` subclass (:func:`resolve_loop`).

This module imports no torch: :mod:`megarl.engines.base` is imported for its types only.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megarl.agent.gateway.settings import GatewaySettings
from megarl.agent.render import ChatRenderer, PrefixBrokenError
from megarl.agent.tool_calls import ParsedTurn, ToolCall, get_tool_format
from megarl.agent.tool_config import load_tools
from megarl.agent.tools.base import Tool, ToolError
from megarl.agent.trajectory import Trajectory
from megarl.errors import BadInputError, RunAborted
from megarl.user_code import describe_user_exception, user_call

if TYPE_CHECKING:
    from megarl.agent.driver import AgentContext

LOOP_KEY = "rollout.agent.loop"
CHARS_PER_TOKEN = 16
"""A tool's answer is cut to ``max_tool_response_tokens * CHARS_PER_TOKEN`` characters before it
is tokenized, so an answer of megabytes costs what its head costs. Tokens average 3-5
characters in text and code, so the token limit, not this cut, decides what the model reads
(where it does not, the note names characters)."""
SINGLE_TURN_NAMES = ("single_turn", "single_turn_agent")
"""The plain rollout's names (megarl's and verl's ``agent_name``): no trajectory is built."""


class AgentLoopError(BadInputError, ValueError):
    """A loop name or class path that names no usable :class:`AgentLoop`: one line, exit 2."""


@dataclass(frozen=True)
class Sample:
    """One response to build: what a loop's ``run`` is given."""

    index: int
    """Its position in the step, group-major (prompt ``g``'s ``k``-th response is ``g * n + k``):
    the order trajectories come back in."""
    prompt_ids: tuple[int, ...]
    """The rendered prompt's token ids (chat template applied): the trajectory starts here."""
    row: Mapping[str, Any] = field(default_factory=dict)
    """The dataset row (verl's schema): ground truth, ``data_source``, and
    ``extra_info.tools_kwargs`` (per-sample tool state, by tool name)."""
    seed: int = 0
    """This sample's own seed: its first generate call's request seed, ``request_seed(step
    seed, index)`` as the trainer's plain ``engine.generate`` seeds prompt ``index`` (see
    :func:`megarl.agent.driver.turn_seed` for later calls)."""
    messages: tuple[Mapping[str, Any], ...] = ()
    """The chat messages ``prompt_ids`` render, for loops that render continuations with the
    chat template (:class:`ToolAgentLoop`); empty: read from the row's ``prompt`` column."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "messages", tuple(self.messages))


@dataclass(frozen=True)
class AgentSettings:
    """The ``rollout.agent.*`` keys. Defaults follow verl's ``multi_turn`` settings where it has
    one (its ``max_tool_response_length`` counts characters; this counts tokens)."""

    loop: str = "single_turn"
    """``single_turn`` | ``tool`` | ``openai`` (an unmodified agent through the gateway, see
    ``entrypoint``) | ``package.module:ClassName`` (rows may override with verl's
    ``agent_name``)."""
    entrypoint: str | None = None
    """``loop=openai``: the agent, ``package.module:function``, called once per sample as
    ``solve(row, llm)`` (:mod:`megarl.agent.gateway`)."""
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    """``loop=openai``: where the gateway listens, how long a session may run."""
    max_turns: int | None = None
    """Generated (assistant) turns per trajectory, verl's ``max_assistant_turns``; None: only
    the response budget (``rollout.max_new_tokens``) ends a trajectory that keeps calling."""
    tool_config_path: str | None = None
    """verl-style tool YAML (:mod:`megarl.agent.tool_config`); None: no tools."""
    max_tool_response_tokens: int = 256
    """A tool's output is cut to this many tokens (a note says so) before it is rendered."""
    tool_timeout_s: float = 30.0
    """Wall-clock limit of one tool call; past it the model reads a timeout error."""
    tool_format: str = "hermes"
    """How calls are written and parsed, one of :data:`megarl.agent.tool_calls.TOOL_FORMATS`:
    hermes (``<tool_call>`` blocks: Qwen2.5, Qwen3) | llama3_json (Llama 3.1, 3.2)."""

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise BadInputError(f"rollout.agent.max_turns={self.max_turns}: must be >= 1 or null")
        if self.max_tool_response_tokens < 1:
            raise BadInputError(
                f"rollout.agent.max_tool_response_tokens={self.max_tool_response_tokens}: "
                "must be >= 1"
            )
        if not self.tool_timeout_s > 0:
            raise BadInputError(
                f"rollout.agent.tool_timeout_s={self.tool_timeout_s}: must be > 0 seconds"
            )
        get_tool_format(self.tool_format)


@dataclass(frozen=True)
class RunFacts:
    """What a loop may need to know of the run beyond ``rollout.agent.*`` (given once, by
    :meth:`AgentLoop.bind_run`, before the first sample)."""

    reward_error: str = "raise"
    """``data.reward_error``: what a failure of the user's code on a sample does."""
    max_prompt_tokens: int | None = None
    """The longest prompt a trajectory may start from (the context less the response budget,
    or ``data.max_prompt_length``); None: not known here."""


class AgentLoop(abc.ABC):
    """Builds one trajectory per sample; subclass and implement :meth:`run`.

    Constructed once per run (by :func:`build_loop`, with keywords), then ``run`` is called for
    every sample of every step, concurrently: keep per-trajectory state in ``run``'s locals,
    not on ``self``. What a subclass builds once per run (a renderer, a client) it builds in
    :meth:`setup`; one that takes arguments of its own overrides ``__init__``, accepting these
    keywords and passing them on.
    """

    def __init__(
        self,
        settings: AgentSettings | None = None,
        tokenizer: Any = None,
        tools: Mapping[str, Tool] | None = None,
    ) -> None:
        """``tools``: by name; None: those of ``settings.tool_config_path`` (what a run gives
        every loop, :class:`LoopChooser`), or none."""
        self.settings = settings if settings is not None else AgentSettings()
        self.tokenizer = tokenizer
        if tools is None and self.settings.tool_config_path:
            tools = load_tools(self.settings.tool_config_path)
        self.tools: dict[str, Tool] = dict(tools or {})
        self.run_facts = RunFacts()
        self.setup()

    def setup(self) -> None:  # noqa: B027 - optional hook, empty by default
        """A subclass's own set-up, once, at the end of the constructor (settings, tokenizer
        and tools set): so that every loop is constructed the same way, with keywords."""

    def bind_run(self, facts: RunFacts) -> None:
        """Told the run's facts once, before the first sample (a subclass may read them)."""
        self.run_facts = facts

    @abc.abstractmethod
    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory | list[Trajectory]:
        """One trajectory for ``sample``, from ``await ctx.generate(...)`` calls; or several
        (branches of one sample: each trains as a sequence with the sample's reward and
        advantage, the first stands for the sample in its group)."""

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids this loop expects for ``messages`` (what :attr:`Sample.prompt_ids`
        must be): the tokenizer's chat template with the generation prompt, as
        :func:`megarl.trainer.rollout.encode_prompt` encodes a prompt."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{type(self).__name__}.prompt_ids needs a tokenizer")
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class SingleTurnLoop(AgentLoop):
    """One generate call of ``rollout.max_new_tokens``: the plain rollout as a loop.

    The driver seeds it and batches it exactly as ``engine.generate(prompts, params)`` does
    (one call, prompts in order, prompt ``i`` seeded ``request_seed(seed, i)``), so a step gives
    bitwise the same tokens and logprobs."""

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        traj = Trajectory(sample.prompt_ids, ctx.max_response_tokens)
        traj.add_generated(await ctx.generate(traj.token_ids))
        return traj


# --- the tool loop --------------------------------------------------------------------------


def prompt_messages(sample: Sample) -> list[dict[str, Any]]:
    """The prompt's chat messages: :attr:`Sample.messages`, else the row's ``prompt`` column
    (verl's: a list of ``{role, content}``, or a string for one user message)."""
    if sample.messages:
        return [dict(m) for m in sample.messages]
    prompt = sample.row.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"sample {sample.index}: the tool loop renders tool results with the chat template and "
        "needs the prompt's chat messages: Sample.messages, or a 'prompt' column of messages"
    )


def tools_kwargs(row: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The row's ``extra_info.tools_kwargs[name]`` (verl's per-sample tool state), or {}."""
    extra = row.get("extra_info")
    per_tool = extra.get("tools_kwargs") if isinstance(extra, Mapping) else None
    kwargs = per_tool.get(name) if isinstance(per_tool, Mapping) else None
    return dict(kwargs) if isinstance(kwargs, Mapping) else {}


def tool_call_name(name: str, hook: str, sample: int) -> str:
    """How a call into a tool is named (warnings, the heartbeat, a dead rank's line)."""
    return f"tool {name}: {hook} (sample {sample})"


class _ToolStates:
    """One trajectory's tool states: each tool's ``create`` runs once, on its first call (two
    concurrent first calls share it), and every created state is released at the end. Every
    hook runs inside :func:`megarl.user_code.user_call`."""

    def __init__(self, tools: Mapping[str, Tool], row: Mapping[str, Any], sample: int) -> None:
        self._tools, self._row, self.sample = tools, row, sample
        self._created: dict[str, asyncio.Task[Any]] = {}

    async def get(self, name: str) -> Any:
        task = self._created.get(name)
        if task is None:
            task = asyncio.ensure_future(self._create(name))
            self._created[name] = task
        return await asyncio.shield(task)

    async def _create(self, name: str) -> Any:
        with user_call(tool_call_name(name, "create", self.sample)):
            return await self._tools[name].create(tools_kwargs(self._row, name))

    async def release(self) -> None:
        """Release every state that was created; a failing release is warned about (the
        trajectory is already built), never raised over the loop's own outcome."""
        for name, task in self._created.items():
            if not task.done():  # a create still running when its call timed out
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                continue
            if task.cancelled() or task.exception() is not None:
                continue
            try:
                with user_call(tool_call_name(name, "release", self.sample)):
                    await self._tools[name].release(task.result())
            except RunAborted:
                raise
            except Exception as exc:  # noqa: BLE001 - a user's release hook; reported, not raised
                warnings.warn(
                    f"tool {name}: release failed: {describe_user_exception(exc)}", stacklevel=1
                )


@dataclass(frozen=True)
class _Answer:
    """One tool call's observation text, and whether the call failed."""

    text: str
    failed: bool


class ToolAgentLoop(AgentLoop):
    """Generate; run the turn's tool calls; render their results; repeat.

    A turn ends the trajectory when the model called no tool, when it did not close its turn
    (its budget ran out, or it stopped on an end-of-sequence token other than the chat
    template's end of turn), after ``max_turns`` generated turns, or when the response budget
    is spent. Otherwise every call of the turn runs concurrently, each under
    ``tool_timeout_s``; whatever goes wrong with a call (unparseable, unknown tool, bad
    arguments, the tool raised or timed out) becomes that call's observation, an error message
    for the model, and counts in ``Trajectory.tool_errors``: a model's mistake never stops the
    run. The results, in call order, are rendered as the chat template renders tool messages
    (:meth:`ChatRenderer.continuation_ids`, glue and next generation prompt included).

    Generated text is decoded only to find the calls; the ids stay as sampled. A template that
    cannot continue the ids exactly (:class:`PrefixBrokenError`) ends the trajectory and counts
    in ``agent/prefix_breaks``.
    """

    def setup(self) -> None:
        if self.tokenizer is None:
            raise ValueError("ToolAgentLoop needs the tokenizer (its chat template renders tools)")
        schemas = [tool.tool_schema for tool in self.tools.values()]
        self.renderer = ChatRenderer(self.tokenizer, schemas, tool_format=self.settings.tool_format)
        self._schemas = {name: tool.tool_schema for name, tool in self.tools.items()}
        self._warned_prefix = False
        self._warned_tools: set[str] = set()

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt with the tools described (by the template, or in the system message)."""
        return self.renderer.prompt_ids(messages)

    async def run(self, sample: Sample, ctx: AgentContext) -> Trajectory:
        messages = prompt_messages(sample)
        if tuple(self.prompt_ids(messages)) != sample.prompt_ids:
            raise ValueError(
                f"sample {sample.index}: prompt_ids are not the tool loop's rendering of the "
                "prompt's messages (tools described): encode tool prompts with "
                "ToolAgentLoop.prompt_ids"
            )
        traj = Trajectory(sample.prompt_ids, ctx.max_response_tokens)
        history: list[dict[str, Any]] = list(messages)
        states = _ToolStates(self.tools, sample.row, sample.index)
        try:
            while True:
                room = traj.remaining
                output = await ctx.generate(traj.token_ids, max_new_tokens=room)
                traj.add_generated(output)
                parsed = self._calls_to_answer(traj, output.token_ids)
                if parsed is None:
                    break
                with ctx.busy():
                    answers = await self._answer(parsed, states)
                traj.tool_calls += len(answers)
                traj.tool_errors += sum(answer.failed for answer in answers)
                history.append(self.renderer.assistant_message(output.token_ids))
                results = [{"role": "tool", "content": answer.text} for answer in answers]
                try:
                    ids = self.renderer.continuation_ids(history, results, traj.token_ids)
                except PrefixBrokenError as exc:
                    self._prefix_broken(exc, ctx)
                    break
                history.extend(results)
                traj.add_observation(ids)
                if traj.truncated:
                    break
        finally:
            await states.release()
        return traj

    def _prefix_broken(self, exc: PrefixBrokenError, ctx: AgentContext) -> None:
        """Count a trajectory the template cannot continue; say why once per run."""
        ctx.count("prefix_breaks")
        if not self._warned_prefix:
            self._warned_prefix = True
            warnings.warn(
                f"{exc}; such trajectories end before the tool results (counted in "
                "agent/prefix_breaks)",
                stacklevel=1,
            )

    def _calls_to_answer(self, traj: Trajectory, turn_ids: Sequence[int]) -> ParsedTurn | None:
        """The turn's tool calls when the loop goes on to answer them; None to end here."""
        if traj.finish_reason != "stop" or traj.truncated:
            return None  # cut by the budget, or interrupted
        if self.settings.max_turns is not None and traj.num_turns >= self.settings.max_turns:
            return None
        if not self.renderer.closes_turn(turn_ids):
            return None  # another end-of-sequence token: the model ended the conversation
        text = self.renderer.decode(turn_ids[:-1])  # parsed only; the ids stay as sampled
        parsed = self.renderer.tool_format.parse(text, self._schemas)
        return parsed if parsed.has_tool_calls else None

    async def _answer(self, parsed: ParsedTurn, states: _ToolStates) -> list[_Answer]:
        """Every item of the turn answered, in order; the calls run concurrently."""
        answers = await asyncio.gather(
            *(
                self._call(item, states)
                if isinstance(item, ToolCall)
                else _immediate(_Answer(f"Error: {item.message}", failed=True))
                for item in parsed.items
            )
        )
        return [self._bounded(answer) for answer in answers]

    async def _call(self, call: ToolCall, states: _ToolStates) -> _Answer:
        """One well-formed call run under the timeout (its tool state's creation, on the first
        call, included); any failure is the model's to read."""
        timeout = self.settings.tool_timeout_s
        try:
            result = await asyncio.wait_for(self._execute(call, states), timeout)
        except asyncio.TimeoutError:
            return _Answer(f"Error: {call.name} timed out after {timeout:g} s", failed=True)
        except ToolError as exc:
            return _Answer(f"Error: {exc}", failed=True)
        except RunAborted:  # a stop (SIGTERM/SIGINT) while the tool ran: the run ends, not the tool
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's bug: the model's error, not a crash
            self._warn_tool_failure(call.name, exc)
            described = describe_user_exception(exc, location=False)
            return _Answer(f"Error: {call.name} failed: {described}", failed=True)
        if not isinstance(result, str):
            kind = type(result).__name__
            self._warn_tool_failure(call.name, TypeError(f"execute returned a {kind}, not a str"))
            return _Answer(f"Error: {call.name} returned a {kind}, not text", failed=True)
        return _Answer(result, failed=False)

    async def _execute(self, call: ToolCall, states: _ToolStates) -> Any:
        state = await states.get(call.name)
        with user_call(tool_call_name(call.name, "execute", states.sample)):
            return await self.tools[call.name].execute(dict(call.arguments), state)

    def _warn_tool_failure(self, name: str, exc: BaseException) -> None:
        """Say once per tool where its code failed (the model reads the error without it)."""
        if name in self._warned_tools:
            return
        self._warned_tools.add(name)
        warnings.warn(
            f"tool {name} failed: {describe_user_exception(exc)}; the model reads it as an "
            "error observation (agent/tool_errors counts them)",
            stacklevel=1,
        )

    def _bounded(self, answer: _Answer) -> _Answer:
        """``answer`` cut to ``max_tool_response_tokens`` (:meth:`_truncate`); a cut answer is
        an error observation (counted in ``agent/tool_errors``), as the docs say."""
        text, cut = self._truncate(answer.text)
        return _Answer(text, answer.failed or cut)

    def _truncate(self, text: str) -> tuple[str, bool]:
        """``text`` cut to ``max_tool_response_tokens`` tokens, saying so (the head is kept:
        a traceback's or a print's start is where the model looks first). Only the first
        :data:`CHARS_PER_TOKEN` characters per token are tokenized: a tool that prints
        megabytes costs what the kept head costs, not a tokenization of the whole. Returns the
        text the model reads and whether it was cut."""
        limit = self.settings.max_tool_response_tokens
        char_limit = limit * CHARS_PER_TOKEN
        head = text[:char_limit]
        ids = self.renderer.encode(head)
        if len(ids) > limit:
            kept = self.renderer.decode(ids[:limit])
            if len(head) < len(text):
                total = f"an answer of {len(text)} characters"
            else:
                total = f"{len(ids)} tokens"
            return f"{kept}\n... (truncated: the first {limit} tokens of {total} shown)", True
        if len(head) < len(text):
            note = f"(truncated: the first {char_limit} of {len(text)} characters shown)"
            return f"{head}\n... {note}", True
        return text, False


async def _immediate(answer: _Answer) -> _Answer:
    return answer


# --- choosing a loop ------------------------------------------------------------------------


BUILT_IN_LOOPS: dict[str, type[AgentLoop]] = {
    "single_turn": SingleTurnLoop,
    "tool": ToolAgentLoop,
    "single_turn_agent": SingleTurnLoop,  # verl's agent_name spellings
    "tool_agent": ToolAgentLoop,
}


GATEWAY_NAMES = ("openai",)
"""The gateway's loop (:mod:`megarl.agent.gateway`): an unmodified agent per sample."""


def resolve_loop(name: str, key: str = LOOP_KEY) -> type[AgentLoop]:
    """The loop class ``name`` denotes: a built-in name, or a class path
    ``package.module:ClassName`` (``package.module.ClassName`` also works). Anything else is a
    one-line :class:`AgentLoopError` naming ``key``."""
    if not isinstance(name, str) or not name.strip():
        raise AgentLoopError(f"{key}={name!r}: expected a loop name or 'package.module:ClassName'")
    if name in BUILT_IN_LOOPS:
        return BUILT_IN_LOOPS[name]
    if name in GATEWAY_NAMES:  # imported here: the gateway's loop imports this module
        from megarl.agent.gateway.agent_loop import GatewayLoop

        return GatewayLoop
    module_name, sep, attribute = name.partition(":")
    if not sep:
        module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute:
        builtins = ", ".join(
            [*(n for n in BUILT_IN_LOOPS if not n.endswith("_agent")), *GATEWAY_NAMES]
        )
        raise AgentLoopError(
            f"{key}={name!r}: not a built-in loop ({builtins}) nor a class path "
            "'package.module:ClassName'"
        )
    cls = _import_attribute(module_name, attribute, f"{key}={name!r}")
    if not isinstance(cls, type) or not issubclass(cls, AgentLoop):
        raise AgentLoopError(f"{key}={name!r} is not a subclass of megarl.agent.AgentLoop")
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise AgentLoopError(f"{key}={name!r} does not implement {missing}")
    return cls


def _import_attribute(module_name: str, attribute: str, where: str) -> object:
    try:
        with user_call(f"{where}: import {module_name}"):
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise AgentLoopError(f"{where}: module {exc.name or module_name!r} not found") from exc
    except RunAborted:
        raise
    except Exception as exc:  # whatever the user's module raised on import
        raise AgentLoopError(
            f"{where}: importing {module_name!r} failed: {describe_user_exception(exc)}"
        ) from exc
    if not hasattr(module, attribute):
        raise AgentLoopError(f"{where}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


def build_loop(
    name: str,
    settings: AgentSettings,
    tokenizer: Any,
    tools: Mapping[str, Tool] | None = None,
    key: str = LOOP_KEY,
) -> AgentLoop:
    """The loop ``name`` denotes, constructed with keywords (once per run). A user's class whose
    constructor raises (an exit included) is a one-line :class:`AgentLoopError` naming ``key``."""
    cls = resolve_loop(name, key)
    if cls in BUILT_IN_LOOPS.values():
        return cls(settings=settings, tokenizer=tokenizer, tools=tools)
    try:
        with user_call(f"{key}={name!r}: {cls.__name__}(...)"):
            return cls(settings=settings, tokenizer=tokenizer, tools=tools)
    except RunAborted:
        raise
    except Exception as exc:  # whatever the user's constructor raised
        raise AgentLoopError(
            f"{key}={name!r}: {cls.__name__}(settings=..., tokenizer=..., tools=...) failed: "
            f"{describe_user_exception(exc)}"
        ) from exc


class LoopChooser:
    """Each sample's loop: its row's ``agent_name`` (verl) when it has one, else
    ``rollout.agent.loop``. The tools are loaded once, and each loop is built on first use and
    kept for the run; a bad name fails on the first sample that uses it."""

    def __init__(
        self, settings: AgentSettings, tokenizer: Any, facts: RunFacts | None = None
    ) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.facts = facts if facts is not None else RunFacts()
        path = settings.tool_config_path
        self.tools: dict[str, Tool] = load_tools(path) if path else {}
        self._loops: dict[str, AgentLoop] = {}

    def __call__(self, sample: Sample) -> AgentLoop:
        name, key = self.settings.loop, LOOP_KEY
        row_name = sample.row.get("agent_name")
        if row_name:
            name, key = str(row_name), f"sample {sample.index}: agent_name"
        loop = self._loops.get(name)
        if loop is None:
            loop = build_loop(name, self.settings, self.tokenizer, self.tools, key)
            loop.bind_run(self.facts)
            self._loops[name] = loop
        return loop


LoopFor = Callable[[Sample], AgentLoop]
"""What the driver accepts besides one loop: the loop of each sample (:class:`LoopChooser`)."""

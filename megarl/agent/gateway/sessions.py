"""One agent session as training data: its requests placed on branches of token-exact
trajectories.

A session is everything one sample's agent asked the gateway (one base URL). Each request
carries the whole conversation as the agent sees it now; the session turns it into token ids
without ever re-tokenising what the model wrote:

* **Extend.** When the request's messages start with a branch's conversation so far -- every
  assistant turn the gateway served matched *by meaning* (:attr:`protocol.Message.meaning`),
  every other message exactly -- the new messages are rendered after the branch's tokens with
  the chat template (:meth:`megarl.agent.render.ChatRenderer.continuation_ids`, prefix
  invariant checked) and appended as an observation (read, never trained); the model's next
  turn is sampled from there and appended as generated (trained).
* **Fork.** When they start with an *earlier* point of a branch (best-of-n, a retried turn, a
  resent request), a new branch starts from that point's tokens. The shared part is the new
  branch's prompt: context it reads, not tokens it trains, so each sampled token trains once.
* **New branch.** Anything else -- the agent compacted or summarised its context, started a
  sub-agent, changed its system prompt, edited an assistant turn, or the template cannot
  continue the tokens exactly -- starts a branch from the template's rendering of the whole
  request, all of it prompt.

Each branch is one :class:`~megarl.agent.trajectory.Trajectory` (its own response budget,
``rollout.max_new_tokens``), so each becomes one training sequence, and only the ids the engine
sampled have mask 1. Assistant messages the agent wrote itself (few-shot examples) are part of
what the model reads.

A session answers its requests one at a time (a lock): placing a request needs the branches as
the previous request left them. What the session cannot honour is a
:class:`~megarl.agent.gateway.protocol.GatewayError`, never an exception out of the step.

This module imports no torch and no HTTP library: the generate call is injected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.agent.gateway.protocol import (
    ChatRequest,
    GatewayError,
    Message,
    Reply,
    canonical_json,
    served_calls,
)
from megarl.agent.render import ChatRenderer, ChatTemplateError, PrefixBrokenError
from megarl.agent.tool_calls import ToolCall
from megarl.agent.trajectory import GenerateOutput, Trajectory

Generate = Callable[[Sequence[int], int, ChatRequest], Awaitable[GenerateOutput]]
"""Sample one turn: (context ids, max new tokens, the request) -> the engine's output. In
training the request's own sampling settings are not used (the run's apply)."""


@dataclass(frozen=True)
class _Entry:
    """One message of a branch's conversation: as clients send it (``client``), as the chat
    template is given it (``template``), and whether the gateway sampled it."""

    client: Message
    template: Mapping[str, Any]
    served: bool = False

    def matches(self, message: Message) -> bool:
        """Whether ``message`` is this entry: a served turn by meaning, others exactly."""
        if self.served:
            return message.meaning == self.client.meaning
        return message.meaning == self.client.meaning and message.content == self.client.content


@dataclass(frozen=True)
class _Turn:
    """Where a served turn sits in its branch: entries before it, tokens before and after."""

    entries_before: int
    tokens_before: int
    tokens_after: int
    closed: bool
    """It ended with the template's end-of-turn token (not a stop string or the budget)."""


@dataclass
class Branch:
    """One token-exact trajectory of the session and the conversation its tokens render."""

    trajectory: Trajectory
    entries: list[_Entry]
    turns: list[_Turn] = field(default_factory=list)


@dataclass
class SessionStats:
    """What the session's requests did (summed into ``agent/gateway/*``)."""

    requests: int = 0
    errors: int = 0
    stream_requests: int = 0
    latency_s: float = 0.0
    forks: int = 0
    prefix_breaks: int = 0
    """New branches started because the template could not continue the tokens exactly."""


def template_message(message: Message, renderer: ChatRenderer) -> dict[str, Any]:
    """``message`` as the chat template is given it: tool calls as the template's
    ``tool_calls`` where it renders tools, else written into the text in the tool format's
    convention (what the model itself writes)."""
    if message.role != "assistant" or not message.tool_calls:
        return {"role": message.role, "content": message.content}
    if renderer.native_tools:
        calls = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
        return {"role": "assistant", "content": message.content, "tool_calls": calls}
    written = renderer.tool_format.calls_text([(c.name, c.arguments) for c in message.tool_calls])
    text = f"{message.content}\n{written}" if message.content else written
    return {"role": "assistant", "content": text}


class Session:
    """One sample's conversation(s) with the gateway (see the module docstring).

    ``renderer_for(tools)`` gives the chat renderer of a request's tool list (cached by the
    caller); ``max_response_tokens`` is each branch's response budget; ``max_turns`` the
    generated turns of the whole session (None: unbounded); ``max_prompt_tokens`` the longest
    prompt a new branch may start from (None: unbounded)."""

    def __init__(
        self,
        generate: Generate,
        renderer_for: Callable[[Sequence[Mapping[str, Any]]], ChatRenderer],
        max_response_tokens: int,
        max_turns: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self._generate, self._renderer_for = generate, renderer_for
        self.max_response_tokens, self.max_turns = max_response_tokens, max_turns
        self.max_prompt_tokens = max_prompt_tokens
        self.branches: list[Branch] = []
        self.stats = SessionStats()
        self.turns = 0
        self.last_reply: Reply | None = None
        """The last turn served: its text is what the dataset's reward scores."""
        self.closed = False
        self.failure: Exception | None = None
        """What failed underneath a request (the engine): the sample's loop raises it once the
        agent is done, so an engine failure stops the step instead of reaching only the agent."""
        self._lock = asyncio.Lock()

    # --- serving ---------------------------------------------------------------------------

    async def complete(self, request: ChatRequest) -> Reply:
        """Place the request, sample the next turn, record it; errors are counted."""
        started = time.perf_counter()
        self.stats.requests += 1
        self.stats.stream_requests += request.stream
        try:
            async with self._lock:
                if self.closed:
                    raise GatewayError(410, "this session has ended (its sample is done)")
                return await self._complete(request)
        except GatewayError:
            self.stats.errors += 1
            raise
        except Exception as exc:  # noqa: BLE001 - the engine failed: the step must fail, not the agent
            self.stats.errors += 1
            self.failure = self.failure or exc
            raise GatewayError(
                500, f"the rollout engine failed: {type(exc).__name__}: {exc}", "api_error"
            ) from None
        finally:
            self.stats.latency_s += time.perf_counter() - started

    async def _complete(self, request: ChatRequest) -> Reply:
        try:
            renderer = self._renderer_for(request.tools)
        except ChatTemplateError as exc:
            raise GatewayError(400, f"the chat template refused the tools: {exc}") from None
        branch = self._place(request, renderer)
        traj = branch.trajectory
        prompt_tokens = len(traj.token_ids)
        room = traj.remaining or 0
        if self.max_turns is not None and self.turns >= self.max_turns:
            room = 0  # rollout.agent.max_turns: the session's turns are spent
        limit = min(request.max_tokens or room, room)
        if limit == 0:
            return Reply("", (), "length", prompt_tokens, 0)
        output = await self._generate(traj.token_ids, limit, request)
        output, stop = _cut_at_stop(output, request.stop, renderer)
        tokens_before = len(traj.token_ids)
        traj.add_generated(output)
        self.turns += 1
        reply, entry = self._reply(output, stop, request, renderer, prompt_tokens)
        closed = renderer.closes_turn(output.token_ids)
        branch.turns.append(
            _Turn(len(branch.entries), tokens_before, len(traj.token_ids), closed and not stop)
        )
        branch.entries.append(entry)
        self.last_reply = reply
        return reply

    # --- placing a request on a branch -------------------------------------------------------

    def _place(self, request: ChatRequest, renderer: ChatRenderer) -> Branch:
        """The branch the request continues (extended in place, or forked), else a new one."""
        messages = request.messages
        for branch in reversed(self.branches):
            for turn in reversed(branch.turns):
                served = turn.entries_before + 1
                if len(messages) > served and _starts_with(messages, branch.entries[:served]):
                    placed = self._continue(branch, turn, messages[served:], renderer)
                    if placed is not None:
                        return placed
                    return self._new_branch(messages, renderer)
                before = turn.entries_before
                if len(messages) == before and _starts_with(messages, branch.entries[:before]):
                    return self._fork(branch, turn.tokens_before, before)
        return self._new_branch(messages, renderer)

    def _continue(
        self, branch: Branch, turn: _Turn, new: Sequence[Message], renderer: ChatRenderer
    ) -> Branch | None:
        """``new`` rendered after ``turn`` of ``branch`` (in place when it is the branch's
        last turn, else on a fork); None when the template cannot continue the tokens."""
        served = turn.entries_before + 1
        if turn is branch.turns[-1] and branch.trajectory.truncated:
            return branch  # its budget is spent: the reply says so (finish_reason length)
        history = [dict(e.template) for e in branch.entries[:served]]
        context = branch.trajectory.token_ids[: turn.tokens_after]
        try:
            ids = renderer.continuation_ids(
                history, [template_message(m, renderer) for m in new], context, turn.closed
            )
        except PrefixBrokenError:
            self.stats.prefix_breaks += 1
            return None
        if turn is not branch.turns[-1]:
            branch = self._fork(branch, turn.tokens_after, served)
        branch.trajectory.add_observation(ids)
        branch.entries.extend(_Entry(m, template_message(m, renderer)) for m in new)
        return branch

    def _fork(self, branch: Branch, tokens: int, entries: int) -> Branch:
        """A new branch whose prompt is ``branch``'s first ``tokens`` ids (context, untrained),
        with what is left of the context after them as its budget (at most a branch's)."""
        budget = self.max_response_tokens
        if self.max_prompt_tokens is not None:
            budget = min(budget, self.max_prompt_tokens + self.max_response_tokens - tokens)
        if budget < 1:
            raise GatewayError(
                400,
                f"context_length_exceeded: the conversation up to this point is {tokens} "
                "tokens, which leaves no room for an answer in this run's context",
            )
        self.stats.forks += 1
        fork = Branch(
            Trajectory(branch.trajectory.token_ids[:tokens], budget), list(branch.entries[:entries])
        )
        self.branches.append(fork)
        return fork

    def _new_branch(self, messages: Sequence[Message], renderer: ChatRenderer) -> Branch:
        entries = [_Entry(m, template_message(m, renderer)) for m in messages]
        try:
            prompt = renderer.prompt_ids([dict(e.template) for e in entries])
        except ChatTemplateError as exc:
            raise GatewayError(400, str(exc).splitlines()[0]) from None
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise GatewayError(
                400,
                f"context_length_exceeded: the conversation is {len(prompt)} tokens, more than "
                f"the {limit} a prompt may have in this run",
            )
        branch = Branch(Trajectory(prompt, self.max_response_tokens), entries)
        self.branches.append(branch)
        return branch

    # --- the reply ----------------------------------------------------------------------------

    def _reply(
        self,
        output: GenerateOutput,
        stop: str | None,
        request: ChatRequest,
        renderer: ChatRenderer,
        prompt_tokens: int,
    ) -> tuple[Reply, _Entry]:
        """The reply the client gets, and the branch entry of the turn (its template text is
        the sampled ids' own text, so later renders continue those ids exactly)."""
        ids = list(output.token_ids)
        closed = renderer.closes_turn(ids)
        own_text = renderer.decode(ids[:-1] if closed else ids)
        text = renderer.tokenizer.decode(
            ids[:-1] if closed else ids, skip_special_tokens=True
        ).strip()
        if stop is not None:
            text = text[: text.find(stop)].rstrip() if stop in text else text
        content, calls, finish = text, (), "length"
        if output.finish_reason == "stop" or stop is not None:
            finish = "stop"
            parsed = _calls(text, request, renderer)
            if parsed is not None:
                content, calls, finish = parsed[0], served_calls(parsed[1]), "tool_calls"
        reply = Reply(
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(ids),
            tokens=tuple(renderer.decode([t]) for t in ids) if request.logprobs else (),
            logprobs=output.logprobs if request.logprobs else (),
            stop_sequence=stop,
        )
        entry = _Entry(reply.message(), {"role": "assistant", "content": own_text}, served=True)
        return reply, entry

    # --- what the session trains -------------------------------------------------------------

    def trajectories(self) -> list[Trajectory]:
        """Each branch that holds a sampled turn, in the order the branches started."""
        return [b.trajectory for b in self.branches if b.trajectory.num_turns]

    def close(self) -> None:
        """No more requests: later ones get 410."""
        self.closed = True


def _starts_with(messages: Sequence[Message], entries: Sequence[_Entry]) -> bool:
    return len(messages) >= len(entries) and all(
        entry.matches(message) for entry, message in zip(entries, messages, strict=False)
    )


def _calls(
    text: str, request: ChatRequest, renderer: ChatRenderer
) -> tuple[str, list[tuple[str, Any]]] | None:
    """The turn's tool calls when the request offered tools and every call the model wrote is
    well formed and names one of them; else None (the text is served as it is, so a
    malformed call reaches the agent as text rather than as a call it would refuse)."""
    if not request.tools:
        return None
    names = {name: {"type": "function", "function": {"name": name}} for name in request.tool_names}
    parsed = renderer.tool_format.parse(text, names)
    if not parsed.items or not all(isinstance(item, ToolCall) for item in parsed.items):
        return None
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


def _cut_at_stop(
    output: GenerateOutput, stops: Sequence[str], renderer: ChatRenderer
) -> tuple[GenerateOutput, str | None]:
    """The output cut after the first token whose text completes a stop string (the tokens
    after it were sampled, but the turn ends there: a prefix of a sample is a sample of the
    prefix), and that stop string; unchanged and None when none occurs."""
    if not stops:
        return output, None
    ids = list(output.token_ids)
    whole = renderer.decode(ids)
    if not any(stop in whole for stop in stops):
        return output, None
    for count in range(1, len(ids) + 1):
        text = renderer.decode(ids[:count])
        hit = min(
            (stop for stop in stops if stop in text), key=lambda s: text.find(s), default=None
        )
        if hit is not None:
            versions = output.versions[:count] if output.versions is not None else None
            cut = GenerateOutput(tuple(ids[:count]), output.logprobs[:count], "stop", versions)
            return cut, hit
    return output, None


def tools_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """A cache key for a request's tool list (renderers are built once per tool list)."""
    return canonical_json(list(tools))

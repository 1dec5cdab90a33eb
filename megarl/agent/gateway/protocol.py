"""The two chat APIs as the gateway reads and answers them: OpenAI Chat Completions and
Anthropic Messages, translated to and from one neutral form.

Everything here is pure data work (JSON in, dataclasses out, and back), so that what real
clients send -- and the ways they differ (§ "what clients send" in ``docs/agents.md``) -- is
tested on plain dictionaries in milliseconds:

* A request becomes a :class:`ChatRequest`: the conversation as neutral :class:`Message` s
  (content as one string, tool calls with *parsed* arguments), the tools as OpenAI function
  schemas, and the sampling asked for. Content may be a string, ``null``, absent, or a list of
  text parts; ``developer`` is a system message; extra keys (``refusal: null``, ``strict``
  tools, ``name`` on tool messages) are ignored. What cannot be honoured (``n > 1``, images,
  an unknown role) is a :class:`GatewayError` with a status and a message the agent can read.
* An assistant message is compared with what the gateway served **by meaning**
  (:attr:`Message.meaning`: its text, trimmed, and each call's name and parsed arguments),
  never by its JSON: LangChain re-serialises arguments, SDKs add or drop null keys, Anthropic
  clients replay content blocks, and all of them mean the same turn.
* A turn the model sampled is answered from a :class:`Reply` (text, tool calls, finish
  reason, token logprobs, usage) in either API, whole or as server-sent events.

Why a neutral form rather than one API translated to the other: the session logic
(:mod:`megarl.agent.gateway.sessions`) must not care which SDK an agent uses, and a session may
even mix them (the same base session serves both).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class GatewayError(Exception):
    """A request the gateway refuses: the HTTP ``status``, the API's error ``kind``
    (``invalid_request_error``, ``authentication_error``, ...) and a one-line message the agent
    reads. Never a crash of the step: the session and the run go on."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def bad_request(message: str) -> GatewayError:
    return GatewayError(400, message)


# --- the neutral form -------------------------------------------------------------------------


def canonical_json(value: Any) -> str:
    """One spelling of a JSON value (sorted keys, no spaces): equal meanings, equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallSpec:
    """One tool call of an assistant message: ``arguments`` parsed from JSON where they parse
    (a client's own malformed arguments stay the string it sent)."""

    name: str
    arguments: Any
    id: str = ""

    @property
    def arguments_json(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Message:
    """One chat message in the neutral form."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCallSpec, ...] = ()
    tool_call_id: str = ""

    @property
    def meaning(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        """What two spellings of the same message share: role, trimmed text, and each call's
        name and arguments (parsed, canonically re-serialised). Tool-call ids are left out:
        a client may renumber them; the calls' order and content identify the turn."""
        calls = tuple((c.name, canonical_json(c.arguments)) for c in self.tool_calls)
        return (self.role, self.content.strip(), calls)


@dataclass(frozen=True)
class ChatRequest:
    """One completion request, whichever API it came in."""

    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    """OpenAI function schemas (``{"type": "function", "function": {...}}``)."""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    model: str = ""

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(str(t["function"]["name"]) for t in self.tools)


@dataclass(frozen=True)
class Reply:
    """What the gateway answers for one sampled turn."""

    content: str
    tool_calls: tuple[ToolCallSpec, ...]
    finish_reason: str
    """OpenAI's words: ``stop``, ``length`` or ``tool_calls``."""
    prompt_tokens: int
    completion_tokens: int
    tokens: tuple[str, ...] = ()
    """Each sampled token's text (for ``logprobs``)."""
    logprobs: tuple[float, ...] = ()
    stop_sequence: str | None = None
    """The stop string that ended the turn, when one did."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def message(self) -> Message:
        """The reply as the assistant message a client sends back next time."""
        return Message("assistant", self.content, self.tool_calls)


# --- reading requests ---------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, null/absent, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for number, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            elif kind in ("tool_use", "tool_result"):
                continue  # Anthropic blocks: read by the caller
            else:
                raise bad_request(
                    f"{where}: content part {number} of type {kind!r} is not supported (text only)"
                )
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string, a list of parts or null")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as parsed JSON where they parse (the string otherwise)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
    return raw if raw is not None else {}


def _number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad_request(f"{key}={value!r}: must be a number in [{low}, {high}]")
    return float(value)


def _positive_int(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_request(f"{key}={value!r}: must be an integer >= 1")
        return value
    return None


def _stops(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise bad_request(f"{key}: must be a string or a list of strings")


def _openai_message(raw: Any, number: int, where: str = "messages") -> Message:
    where = f"{where}[{number}]"
    if not isinstance(raw, Mapping):
        raise bad_request(f"{where}: must be an object with a role")
    role = raw.get("role")
    role = "system" if role == "developer" else role
    if role not in ROLES:
        raise bad_request(f"{where}: unknown role {role!r} (system, user, assistant, tool)")
    calls = []
    for index, call in enumerate(raw.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{index}]: needs function.name")
        args = _arguments(function.get("arguments"))
        calls.append(ToolCallSpec(function["name"], args, str(call.get("id") or "")))
    return Message(
        role, _text(raw.get("content"), where), tuple(calls), str(raw.get("tool_call_id") or "")
    )


def _openai_tools(raw: Any) -> tuple[Mapping[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request("tools: must be a list of function tools")
    tools = []
    for number, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{number}]: expected {{'type': 'function', 'function': ...}}")
        kept = {k: function[k] for k in ("name", "description", "parameters") if k in function}
        tools.append({"type": "function", "function": kept})
    return tuple(tools)


def parse_messages(raw: Any, where: str = "messages") -> tuple[Message, ...]:
    """A list of OpenAI chat messages in the neutral form (``where`` names them in errors)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request(f"{where}: a non-empty list is required")
    return tuple(_openai_message(m, i, where) for i, m in enumerate(raw))


def parse_tools(raw: Any) -> tuple[Mapping[str, Any], ...]:
    """OpenAI function tools (``[{"type": "function", "function": {...}}]``), kept as schemas."""
    return _openai_tools(raw)


def parse_openai(body: Any) -> ChatRequest:
    """A ``POST /v1/chat/completions`` body as a :class:`ChatRequest`."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    messages = parse_messages(body.get("messages"))
    n = body.get("n")
    if n not in (None, 1):
        raise bad_request(f"n={n!r}: this gateway samples one choice per request (n=1)")
    top_logprobs = body.get("top_logprobs") or 0
    if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise bad_request(f"top_logprobs={top_logprobs!r}: must be an integer in [0, 20]")
    return ChatRequest(
        messages=messages,
        tools=_openai_tools(body.get("tools")),
        max_tokens=_positive_int(body, "max_completion_tokens", "max_tokens"),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        stop=_stops(body.get("stop"), "stop"),
        stream=bool(body.get("stream")),
        logprobs=bool(body.get("logprobs")),
        top_logprobs=top_logprobs,
        model=str(body.get("model") or ""),
    )


def _anthropic_blocks(role: str, content: Any, where: str) -> list[Message]:
    """One Anthropic message as neutral messages: a user message's ``tool_result`` blocks
    become tool messages (first, in order), an assistant's ``tool_use`` blocks its calls."""
    if isinstance(content, str) or content is None:
        return [Message(role, _text(content, where))]
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of blocks")
    text = _text(content, where)
    blocks = [b for b in content if isinstance(b, Mapping)]
    if role == "assistant":
        calls = tuple(
            ToolCallSpec(str(b.get("name")), b.get("input") or {}, str(b.get("id") or ""))
            for b in blocks
            if b.get("type") == "tool_use"
        )
        return [Message("assistant", text, calls)]
    out = [
        Message("tool", _text(b.get("content"), where), tool_call_id=str(b.get("tool_use_id")))
        for b in blocks
        if b.get("type") == "tool_result"
    ]
    if text or not out:
        out.append(Message("user", text))
    return out


def parse_anthropic(body: Any) -> ChatRequest:
    """A ``POST /v1/messages`` body as a :class:`ChatRequest`."""
    if not isinstance(body, Mapping):
        raise bad_request("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages: a non-empty list is required")
    messages: list[Message] = []
    system = _text(body.get("system"), "system")
    if system:
        messages.append(Message("system", system))
    for number, raw in enumerate(raw_messages):
        where = f"messages[{number}]"
        role = raw.get("role") if isinstance(raw, Mapping) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}: role must be 'user' or 'assistant', got {role!r}")
        messages.extend(_anthropic_blocks(role, raw.get("content"), where))
    tools = []
    for number, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{number}]: needs a name")
        function = {"name": tool["name"], "description": tool.get("description", "")}
        function["parameters"] = tool.get("input_schema") or {"type": "object"}
        tools.append({"type": "function", "function": function})
    return ChatRequest(
        messages=tuple(messages),
        tools=tuple(tools),
        max_tokens=_positive_int(body, "max_tokens"),
        temperature=_number(body, "temperature", 0.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        stop=_stops(body.get("stop_sequences"), "stop_sequences"),
        stream=bool(body.get("stream")),
        model=str(body.get("model") or ""),
    )


# --- answering: OpenAI ---------------------------------------------------------------------------


def _openai_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json},
        }
        for call in reply.tool_calls
    ]


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _openai_logprobs(reply: Reply) -> dict[str, Any]:
    """Each sampled token and its logprob (``top_logprobs`` lists are empty: the engines
    report the sampled token's logprob only)."""
    return {
        "content": [
            {
                "token": token,
                "logprob": logprob,
                "bytes": list(token.encode()),
                "top_logprobs": [],
            }
            for token, logprob in zip(reply.tokens, reply.logprobs, strict=True)
        ]
    }


def openai_response(reply: Reply, model: str, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": reply.content if reply.content or not reply.tool_calls else None,
        "refusal": None,
    }
    if reply.tool_calls:
        message["tool_calls"] = _openai_calls(reply)
    return {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": reply.finish_reason,
                "logprobs": _openai_logprobs(reply) if logprobs else None,
            }
        ],
        "usage": _usage(reply),
    }


def openai_stream(reply: Reply, model: str, logprobs: bool) -> Iterator[str]:
    """The reply as ``chat.completion.chunk`` server-sent events: the role, the text, each
    tool call, then the finish reason with the usage, then ``[DONE]``."""
    head = {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], token_logprobs: dict[str, Any] | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": token_logprobs}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if reply.content:
        yield chunk({"content": reply.content}, _openai_logprobs(reply) if logprobs else None)
    for index, call in enumerate(_openai_calls(reply)):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    final = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]}
    final["usage"] = _usage(reply)
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


def openai_error(error: GatewayError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind, "param": None, "code": None}}


# --- answering: Anthropic ------------------------------------------------------------------------


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _anthropic_stop_reason(reply: Reply) -> str:
    if reply.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS[reply.finish_reason]


def _anthropic_blocks_of(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    blocks.extend(
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        for call in reply.tool_calls
    )
    return blocks


def anthropic_response(reply: Reply, model: str) -> dict[str, Any]:
    return {
        "id": f"msg_{reply.id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _anthropic_blocks_of(reply),
        "stop_reason": _anthropic_stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
    }


def anthropic_stream(reply: Reply, model: str) -> Iterator[str]:
    """The reply as the Messages API's events: ``message_start``, each content block (start,
    one delta, stop), ``message_delta`` with the stop reason, ``message_stop``."""

    def event(name: str, data: Mapping[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    start = anthropic_response(reply, model)
    start.update(content=[], stop_reason=None, stop_sequence=None)
    start["usage"] = {"input_tokens": reply.prompt_tokens, "output_tokens": 0}
    yield event("message_start", {"message": start})
    for index, block in enumerate(_anthropic_blocks_of(reply)):
        if block["type"] == "text":
            opened = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield event("content_block_start", {"index": index, "content_block": opened})
        yield event("content_block_delta", {"index": index, "delta": delta})
        yield event("content_block_stop", {"index": index})
    yield event(
        "message_delta",
        {
            "delta": {
                "stop_reason": _anthropic_stop_reason(reply),
                "stop_sequence": reply.stop_sequence,
            },
            "usage": {"output_tokens": reply.completion_tokens},
        },
    )
    yield event("message_stop", {})


def anthropic_error(error: GatewayError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error.kind, "message": error.message}}


def served_calls(calls: Sequence[tuple[str, Any]]) -> tuple[ToolCallSpec, ...]:
    """Parsed model calls as served tool calls, each with a fresh id."""
    return tuple(
        ToolCallSpec(name, arguments, f"call_{uuid.uuid4().hex[:24]}") for name, arguments in calls
    )

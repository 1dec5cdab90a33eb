"""Reading the tool calls out of a model's turn, and telling a model how to make them.

A :class:`ToolFormat` is one calling convention: how calls appear in generated text, how the
tools and the convention are described to a model whose chat template cannot render tools,
and how results are shown to it then. ``hermes`` is the one Qwen2.5/Qwen3 (and Hermes,
verl's and most open agent recipes) use::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 + 7"}}
    </tool_call>

one block per call, several per turn allowed. ``llama3_json`` is Llama 3.1/3.2's: the whole
turn is ``{"name": ..., "parameters": {...}}`` (several joined by ``;``). Others can be
registered in :data:`TOOL_FORMATS` (config: ``rollout.agent.tool_format``).

Parsing never raises on what the model wrote: every block becomes either a :class:`ToolCall`
(well-formed, a known tool, arguments that fit its JSON schema) or a :class:`ToolCallError`
whose message is written for the model to read as that call's result. Checking arguments
against the schema is deliberately basic -- the top-level ``properties`` / ``required`` /
``additionalProperties: false``, the JSON types and ``enum`` -- enough to answer the common
mistakes with a precise message without a JSON-Schema dependency; a tool checks anything
deeper itself and raises :class:`megarl.agent.tools.base.ToolError`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.errors import BadInputError


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a known tool; ``arguments`` fit its schema's basic checks."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A call that cannot be run; ``message`` is what the model reads as its result."""

    message: str
    name: str | None = None
    """The tool name, when the call got that far."""


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: its text outside tool-call blocks, and every block in order."""

    content: str
    items: tuple[ToolCall | ToolCallError, ...] = ()

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(item for item in self.items if isinstance(item, ToolCall))

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(item.message for item in self.items if isinstance(item, ToolCallError))

    @property
    def has_tool_calls(self) -> bool:
        """The model tried to call a tool (even badly): the loop answers every item."""
        return bool(self.items)


class ToolFormat(ABC):
    """A calling convention: parse calls from text, describe tools and results in plain text."""

    name: str

    @abstractmethod
    def parse(self, text: str, tools: Mapping[str, Mapping[str, Any]]) -> ParsedTurn:
        """The calls in ``text``; ``tools`` maps each tool name to its OpenAI tool schema."""

    @abstractmethod
    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        """The tools and the convention as system-message text, for chat templates that
        render no tools themselves."""

    @abstractmethod
    def results_text(self, results: Sequence[str]) -> str:
        """Consecutive tool results as the text of one user message, for chat templates
        without a tool role (what :meth:`system_prompt` told the model to expect)."""

    @abstractmethod
    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        """``(name, arguments)`` calls written as a model writes them in this convention: an
        assistant turn someone else wrote (an agent's history) rendered for a template that
        renders no tool calls itself."""


# --- checking arguments against a tool's JSON schema ----------------------------------------


def _kind(value: object) -> str:
    """A JSON value's type in words, for messages the model reads."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_type(value: object, json_type: str) -> bool | None:
    """Whether ``value`` is of JSON-Schema type ``json_type``; None for a type name not known
    (not checked)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    checks = {
        "string": isinstance(value, str),
        "number": is_number,
        "integer": is_number and float(value).is_integer(),  # type: ignore[arg-type]
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
        "null": value is None,
    }
    return checks.get(json_type)


def _short(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _argument_problem(key: str, value: object, spec: Mapping[str, Any]) -> str | None:
    """What is wrong with argument ``key`` under its property schema ``spec``, or None."""
    declared = spec.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    verdicts = [_is_type(value, t) for t in types if isinstance(t, str)]
    if verdicts and not any(verdicts) and None not in verdicts:
        wanted = " or ".join(types)
        return f"argument {key!r} must be of type {wanted}, got {_kind(value)} ({_short(value)})"
    enum = spec.get("enum")
    if isinstance(enum, list) and value not in enum:
        allowed = ", ".join(_short(choice) for choice in enum)
        return f"argument {key!r} must be one of {allowed}, got {_short(value)}"
    return None


def parameters_of(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``parameters`` JSON schema of an OpenAI tool schema (or of its ``function``)."""
    function = schema.get("function", schema)
    parameters = function.get("parameters") if isinstance(function, Mapping) else None
    return parameters if isinstance(parameters, Mapping) else {}


def argument_problems(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> list[str]:
    """Every basic mismatch between ``arguments`` and a ``parameters`` object schema."""
    properties = parameters.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    problems = [
        f"missing required argument {key!r}"
        for key in parameters.get("required") or ()
        if key not in arguments
    ]
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if parameters.get("additionalProperties") is False:
                known = ", ".join(properties) or "none"
                problems.append(f"unexpected argument {key!r} (the arguments are: {known})")
            continue
        problem = _argument_problem(key, value, spec) if isinstance(spec, Mapping) else None
        if problem:
            problems.append(problem)
    return problems


def checked_call(
    call: object, number: int, tools: Mapping[str, Mapping[str, Any]], arguments_key: str
) -> ToolCall | ToolCallError:
    """A decoded call object (``{"name": ..., <arguments_key>: {...}}``) as a checked call of a
    known tool, or the error the model reads as call ``number``'s result."""
    where = f"tool call {number}"
    expected = f'{{"name": <function-name>, "{arguments_key}": <args-json-object>}}'
    if not isinstance(call, dict):
        return ToolCallError(f"{where}: expected a JSON object {expected}, got {_kind(call)}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(f'{where}: no "name" (a string): expected {expected}')
    if name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return ToolCallError(f"{where}: unknown tool {name!r} (the tools are: {known})", name)
    arguments = call.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return ToolCallError(
            f'{where} ({name}): "{arguments_key}" must be a JSON object, got {_kind(arguments)}',
            name,
        )
    problems = argument_problems(arguments, parameters_of(tools[name]))
    if problems:
        return ToolCallError(f"{where} ({name}): {'; '.join(problems)}", name)
    return ToolCall(name, arguments)


# --- hermes ---------------------------------------------------------------------------------


_HERMES_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_CALL_HOWTO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_HERMES_RESULTS_NOTE = (
    "\n\nThe results come back in the next user message, one <tool_response></tool_response> "
    "block per call, in the order of the calls."
)


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5/Qwen3)."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str, tools: Mapping[str, Mapping[str, Any]]) -> ParsedTurn:
        items: list[ToolCall | ToolCallError] = []
        content: list[str] = []
        position = 0
        while True:
            start = text.find(self.open_tag, position)
            stray = text.find(self.close_tag, position)
            if stray != -1 and (start == -1 or stray < start):
                content.append(text[position:stray])
                items.append(
                    ToolCallError(
                        f"tool call {len(items) + 1}: {self.close_tag} "
                        f"without an opening {self.open_tag}"
                    )
                )
                position = stray + len(self.close_tag)
                continue
            if start == -1:
                content.append(text[position:])
                break
            content.append(text[position:start])
            body = start + len(self.open_tag)
            end = text.find(self.close_tag, body)
            reopened = text.find(self.open_tag, body)
            if end == -1 or (reopened != -1 and reopened < end):
                items.append(
                    ToolCallError(
                        f"tool call {len(items) + 1}: {self.open_tag} is "
                        f"not closed by {self.close_tag}"
                    )
                )
                if end == -1:
                    break
                position = reopened
                continue
            items.append(self._call(text[body:end], len(items) + 1, tools))
            position = end + len(self.close_tag)
        return ParsedTurn("".join(content).strip(), tuple(items))

    def _call(
        self, body: str, number: int, tools: Mapping[str, Mapping[str, Any]]
    ) -> ToolCall | ToolCallError:
        """One block's JSON as a checked call, or the error the model reads."""
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCallError(
                f"tool call {number}: malformed JSON ({exc.msg} at line {exc.lineno}, "
                f"column {exc.colno})"
            )
        return checked_call(call, number, tools, "arguments")

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        listed = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in schemas)
        return _HERMES_TOOLS_INTRO + listed + _HERMES_CALL_HOWTO + _HERMES_RESULTS_NOTE

    def results_text(self, results: Sequence[str]) -> str:
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)

    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{self.open_tag}\n"
            f"{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n"
            f"{self.close_tag}"
            for name, arguments in calls
        )


# --- llama3_json ----------------------------------------------------------------------------


_LLAMA3_TOOLS_INTRO = (
    "You have access to the following functions. To call one, respond with only a JSON object "
    'of the form {"name": function name, "parameters": dictionary of argument name and its '
    'value}; several calls are separated by "; ". Do not use variables.\n\n'
)
_LLAMA3_RESULTS_NOTE = (
    'The results come back in the next user message, one {"output": ...} JSON object per line, '
    "in the order of the calls."
)
PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1/3.2's JSON tool calls: a turn that is ``{"name": ..., "parameters": {...}}``
    (several joined by ``;``, optionally after ``<|python_tag|>``), what their chat templates
    ask for and render back; a turn that does not start with ``{`` is a plain answer.
    ``"arguments"`` is accepted in place of ``"parameters"``."""

    name = "llama3_json"

    def parse(self, text: str, tools: Mapping[str, Mapping[str, Any]]) -> ParsedTurn:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip())
        decoder = json.JSONDecoder()
        items: list[ToolCall | ToolCallError] = []
        position = 0
        while position < len(body):
            number = len(items) + 1
            try:
                call, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError as exc:
                items.append(
                    ToolCallError(f"tool call {number}: malformed JSON ({exc.msg}, at {exc.pos})")
                )
                return ParsedTurn("", tuple(items))
            key = (
                "parameters"
                if not (isinstance(call, dict) and "arguments" in call)
                else "arguments"
            )
            items.append(checked_call(call, number, tools, key))
            rest = body[position:].lstrip()
            if not rest.startswith(";"):
                return ParsedTurn(rest, tuple(items))
            position = len(body) - len(rest[1:].lstrip())
        return ParsedTurn("", tuple(items))

    def system_prompt(self, schemas: Sequence[Mapping[str, Any]]) -> str:
        listed = "".join(json.dumps(schema, ensure_ascii=False) + "\n\n" for schema in schemas)
        return _LLAMA3_TOOLS_INTRO + listed + _LLAMA3_RESULTS_NOTE

    def results_text(self, results: Sequence[str]) -> str:
        return "\n".join(json.dumps({"output": result}, ensure_ascii=False) for result in results)

    def calls_text(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
            for name, arguments in calls
        )


TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "llama3_json": Llama3JsonFormat()}
"""The calling conventions by their ``rollout.agent.tool_format`` name."""


def get_tool_format(name: str, key: str = "rollout.agent.tool_format") -> ToolFormat:
    """The format called ``name``; a one-line bad-input error naming ``key`` otherwise."""
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        known = ", ".join(TOOL_FORMATS)
        raise BadInputError(f"{key}={name!r}: must be one of {known}") from None


def parse_tool_calls(
    text: str, tools: Mapping[str, Mapping[str, Any]], tool_format: str = "hermes"
) -> ParsedTurn:
    """The tool calls in a model's turn ``text`` (``tools``: name -> OpenAI tool schema)."""
    return get_tool_format(tool_format).parse(text, tools)


def render_tools_system_prompt(
    schemas: Sequence[Mapping[str, Any]], tool_format: str = "hermes"
) -> str:
    """The system-message text that describes ``schemas`` and how to call them, for chat
    templates that render no tools (e.g. SmolLM2's: role and content only)."""
    return get_tool_format(tool_format).system_prompt(schemas)

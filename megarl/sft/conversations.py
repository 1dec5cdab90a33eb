"""SFT rows as token ids with a mask: which tokens are the assistant's, rendered exactly as the
agent loops and the gateway render conversations.

A row is verl's SFT schema: a ``messages`` column of OpenAI chat messages (multi-turn,
assistant ``tool_calls``, ``tool`` messages) with an optional ``tools`` column of OpenAI tool
schemas, or a ``prompt`` (messages or a string) and a ``response`` string.

**Token layout, and why.** A conversation is tokenized the way a rollout builds it
(:mod:`megarl.agent.render`): the prompt up to the first assistant turn's generation prompt
(:meth:`ChatRenderer.prompt_ids`), then each assistant turn's text encoded alone followed by the
template's end-of-turn token (what the model samples and where it stops), then the template's
glue, the following non-assistant messages and the next generation prompt
(:meth:`ChatRenderer.continuation_ids`, prefix invariant checked). So the ids the model is
fine-tuned on are the ids it will read and write in an agent loop: the same prompt encoding,
turn boundaries and tool convention. Tool calls in assistant messages are rendered as the
template renders them where it supports tools, else written in the tool format the loops parse
(hermes ``<tool_call>`` blocks by default, described in the system message), so an SFT'd model
calls tools exactly as the tool loop reads them.

The mask is 1 on each assistant turn's tokens (its end-of-turn token included: the model
learns to stop) and 0 everywhere else. Rows that cannot be trained on faithfully are
:class:`BadRow` s, named by ``file:row``.

Imports no torch: a tokenizer object is given.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.agent.gateway.protocol import GatewayError, Message, parse_messages, parse_tools
from megarl.agent.gateway.sessions import template_message
from megarl.agent.render import ChatRenderer, ChatTemplateError


class BadRow(ValueError):
    """A row that cannot be trained on: the message says why (the caller adds ``file:row``)."""


@dataclass(frozen=True)
class Conversation:
    """One row's chat messages and tool schemas."""

    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class SFTExample:
    """One conversation as a training sequence: ``token_ids[:prompt_len]`` is read only, and
    ``mask`` (one per later token) is 1 on the assistant's tokens."""

    location: str
    token_ids: tuple[int, ...]
    prompt_len: int
    mask: tuple[int, ...]

    @property
    def trained_tokens(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class SFTKeys:
    """Which columns hold what (``data.*_key``), and the run's system prompt."""

    messages: str = "messages"
    prompt: str = "prompt"
    response: str = "response"
    tools: str = "tools"
    system_prompt: str | None = None


def _json_column(value: Any, what: str) -> Any:
    """A column that may hold JSON text (parquet writers often store lists as strings)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise BadRow(f"{what} is a string that is not JSON ({exc.msg})") from None
    return value


def conversation_of(row: Mapping[str, Any], keys: SFTKeys) -> Conversation:
    """The row's messages (``messages``, or ``prompt`` + ``response``) and tools; the run's
    system prompt first where the row brings none."""
    try:
        if row.get(keys.messages) is not None:
            messages = parse_messages(
                _json_column(row[keys.messages], keys.messages), keys.messages
            )
        elif row.get(keys.prompt) is not None and row.get(keys.response) is not None:
            prompt = row[keys.prompt]
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            prompt = list(_json_column(prompt, keys.prompt))
            response = {"role": "assistant", "content": str(row[keys.response])}
            messages = parse_messages([*prompt, response], keys.prompt)
        else:
            raise BadRow(
                f"no {keys.messages!r} column, nor {keys.prompt!r} and {keys.response!r} columns"
            )
        tools = parse_tools(_json_column(row.get(keys.tools), keys.tools))
    except GatewayError as exc:
        raise BadRow(exc.message) from None
    if keys.system_prompt and messages[0].role != "system":
        messages = (Message("system", keys.system_prompt), *messages)
    _check_messages(messages)
    return Conversation(messages, tools)


def _check_messages(messages: Sequence[Message]) -> None:
    if not any(m.role == "assistant" for m in messages):
        raise BadRow("no assistant turn to train on")
    for number, message in enumerate(messages):
        for call_number, call in enumerate(message.tool_calls):
            if isinstance(call.arguments, str):
                raise BadRow(
                    f"messages[{number}].tool_calls[{call_number}] ({call.name}): the arguments "
                    "are not valid JSON"
                )
        if number and message.role == "assistant" and messages[number - 1].role == "assistant":
            raise BadRow(f"messages[{number}]: two assistant messages in a row (merge them)")


def tokenize(conversation: Conversation, renderer: ChatRenderer, location: str) -> SFTExample:
    """The conversation's ids and assistant mask (see the module docstring); a template that
    cannot render it faithfully is a :class:`BadRow`."""
    templates = [template_message(m, renderer) for m in conversation.messages]
    roles = [m.role for m in conversation.messages]
    first = roles.index("assistant")
    try:
        ids = renderer.prompt_ids(templates[:first])
        prompt_len, mask = len(ids), []
        turn = first
        while turn < len(templates):
            generated = renderer.encode(_turn_text(renderer, templates, turn))
            generated.append(renderer.end_of_turn_id)
            ids += generated
            mask += [1] * len(generated)
            after = turn + 1
            while after < len(roles) and roles[after] != "assistant":
                after += 1
            if after == len(roles):
                break  # what follows the last assistant turn trains nothing: left out
            glue = renderer.continuation_ids(
                templates[: turn + 1], templates[turn + 1 : after], ids
            )
            ids += glue
            mask += [0] * len(glue)
            turn = after
    except ChatTemplateError as exc:
        raise BadRow(str(exc).splitlines()[0]) from None
    return SFTExample(location, tuple(ids), prompt_len, tuple(mask))


def _turn_text(renderer: ChatRenderer, templates: Sequence[Mapping[str, Any]], turn: int) -> str:
    """Assistant message ``turn``'s text as the template renders it, without its end-of-turn
    token: what the model writes after the generation prompt."""
    before = renderer.render_text(templates[:turn], add_generation_prompt=True)
    whole = renderer.render_text(templates[: turn + 1], add_generation_prompt=False)
    if not whole.startswith(before):
        raise ChatTemplateError(
            f"the chat template does not render assistant message {turn} after its generation "
            "prompt (the conversation is not a prefix of itself with the turn)"
        )
    end = len(whole) - len(renderer.after_turn) - len(renderer.end_of_turn)
    return whole[len(before) : end]


def load_examples(
    rows: Sequence[tuple[str, Mapping[str, Any]]],
    renderer_for: Callable[[Sequence[Mapping[str, Any]]], ChatRenderer],
    keys: SFTKeys,
    max_length: int,
    skip_bad_rows: bool,
) -> tuple[list[SFTExample], list[str]]:
    """Every ``(file:row, row)`` as an example; bad rows raise :class:`BadRow` naming the
    first (``file:row: why``), or with ``skip_bad_rows`` are left out and listed."""
    examples: list[SFTExample] = []
    skipped: list[str] = []
    for location, row in rows:
        try:
            conversation = conversation_of(row, keys)
            example = tokenize(conversation, renderer_for(conversation.tools), location)
            if len(example.token_ids) > max_length:
                raise BadRow(
                    f"{len(example.token_ids)} tokens, more than the {max_length} allowed "
                    "(data.max_length, or the model's context)"
                )
        except BadRow as exc:
            if not skip_bad_rows:
                raise BadRow(
                    f"{location}: {exc} (data.skip_bad_rows=true leaves such rows out)"
                ) from None
            skipped.append(f"{location}: {exc}")
            continue
        examples.append(example)
    return examples, skipped

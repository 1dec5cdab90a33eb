"""The unit of work the trainer samples: one prompt with its ground-truth answer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer a correct response must contain.

    Attributes:
        prompt: The user message text without any chat template; the trainer applies the
            tokenizer's own template so the same data works for any model.
        answer: Ground truth as a normalised number string (``"1234"``, ``"-3"``, ``"2.5"``),
            compared numerically by the reward functions.
        source: Where the problem came from (``"arithmetic#17"``, ``"train.jsonl:12"``), so a
            surprising sample in a log or error message can be traced back to its origin.
    """

    prompt: str
    answer: str
    source: str
    messages: tuple[tuple[str, str], ...] = ()
    """The prompt as ``(role, content)`` chat messages when the dataset gave them (ending with
    the user's, whose content is ``prompt``); empty = one user message, ``prompt``."""
    data_source: str = ""
    """verl's ``data_source`` column (e.g. ``openai/gsm8k``) where the dataset has one."""
    agent_name: str = ""
    """verl's ``agent_name`` column: the agent loop this row runs under (``tool_agent``, a class
    path); empty: ``rollout.agent.loop``."""
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """verl's ``extra_info.tools_kwargs``: per tool name, what its ``create`` receives for this
    row (e.g. ``{"calc": {"create_kwargs": {...}}}``)."""

    @property
    def chat(self) -> tuple[tuple[str, str], ...]:
        """The messages the chat template is applied to."""
        return self.messages or (("user", self.prompt),)

    def chat_messages(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        """:attr:`chat` as ``{role, content}`` messages, ``system_prompt`` (``data.system_prompt``)
        first unless the dataset's messages bring their own system message."""
        messages = [{"role": role, "content": content} for role, content in self.chat]
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages

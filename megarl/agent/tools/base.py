"""What a tool is to the agent loop: a named function the model may call, in verl's tool-YAML
shape (``class_name``, ``config``, ``tool_schema`` in OpenAI function format), so a verl user's
tools and configs carry over.

A tool instance serves every trajectory of a run; per-trajectory state (a sandbox folder, the
sample's ``extra_info.tools_kwargs``) is what :meth:`Tool.create` returns and what
:meth:`Tool.execute` and :meth:`Tool.release` are given back. A tool reports failure by raising:
the loop turns the exception into an error observation for the model (counted in
``agent/tool_errors``), never a crashed run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class ToolError(Exception):
    """A failure the model should read (bad arguments, code that raised, a timeout): the loop
    shows ``str(error)`` as the tool's observation."""


class Tool(ABC):
    """Subclass and implement :meth:`execute`; found by class path from the tool YAML."""

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        self.config = dict(config)
        self.tool_schema = tool_schema

    @property
    def name(self) -> str:
        """The function name the model calls (``tool_schema.function.name``)."""
        return self.tool_schema["function"]["name"]

    async def create(self, tools_kwargs: dict[str, Any]) -> Any:
        """Per-trajectory state from the sample's ``extra_info.tools_kwargs[<name>]``, given
        whole (verl's rows nest ``create_kwargs`` and ``execute_kwargs`` in it: a tool ported
        from verl reads them from there); default: that dict itself."""
        return tools_kwargs

    @abstractmethod
    async def execute(self, arguments: dict[str, Any], state: Any) -> str:
        """Run one call with the model's parsed ``arguments``; returns the observation text."""

    async def release(self, state: Any) -> None:  # noqa: B027 - optional hook, empty by default
        """Free the per-trajectory state when its trajectory ends (also after an error)."""

"""Tools from a verl-style tool YAML: each entry's class by its dotted path, built with its config.

The file format is verl's (``actor_rollout_ref.rollout.multi_turn.tool_config_path``), so a
verl user's tool configs carry over::

    tools:
      - class_name: my_package.tools.Calculator
        config: {timeout_s: 5}
        tool_schema:
          type: function
          function:
            name: calculator
            description: Evaluate an arithmetic expression.
            parameters:
              type: object
              properties: {expression: {type: string}}
              required: [expression]

Loading happens at start-up, before any engine or process group: every mistake is a
:class:`ToolConfigError` (exit 2) of one line naming the file, the entry (``tools[i]``) and what
is wrong, so a run never starts with a tool that cannot be called. The schema is checked for the
OpenAI function shape the chat templates render and :mod:`megarl.agent.tool_calls` validates
arguments against.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from megarl.agent.tools.base import Tool
from megarl.errors import BadInputError, RunAborted
from megarl.user_code import describe_user_exception, user_call

ENTRY_KEYS = ("class_name", "config", "tool_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function name (what the model writes in its call)."""


class ToolConfigError(BadInputError, ValueError):
    """A tool YAML that cannot be used; the one-line message names the file and the entry."""


def load_tools(path: str | Path) -> dict[str, Tool]:
    """The tools ``path`` lists, built and keyed by name (in file order)."""
    entries = _read_entries(Path(path))
    tools: dict[str, Tool] = {}
    where_named: dict[str, int] = {}
    for index, entry in enumerate(entries):
        where = f"tool config {path}: tools[{index}]"
        tool = _build(entry, where)
        if tool.name in where_named:
            raise ToolConfigError(
                f"{where}: duplicate tool name {tool.name!r} (also tools[{where_named[tool.name]}])"
            )
        where_named[tool.name] = index
        tools[tool.name] = tool
    return tools


def _read_entries(path: Path) -> list[Any]:
    """The ``tools`` list of the YAML file at ``path``."""
    where = f"tool config {path}"
    if not path.is_file():
        raise ToolConfigError(f"{where}: no such file")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ToolConfigError(f"{where}: not valid YAML ({problem}{at})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolConfigError(f"{where}: cannot be read ({exc})") from exc
    if not isinstance(document, dict) or "tools" not in document:
        raise ToolConfigError(f"{where}: expected a mapping with a 'tools' list at the top")
    entries = document["tools"]
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{where}: 'tools' must be a non-empty list of tool entries")
    return entries


def _build(entry: object, where: str) -> Tool:
    """One entry's tool instance, every key checked first."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with keys {', '.join(ENTRY_KEYS)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS), key=str)
    if unknown:
        raise ToolConfigError(
            f"{where}: unknown key {unknown[0]!r} (the keys are {', '.join(ENTRY_KEYS)})"
        )
    for key in ("class_name", "tool_schema"):
        if key not in entry:
            raise ToolConfigError(f"{where}: missing key {key!r}")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
    check_tool_schema(entry["tool_schema"], where)
    cls = _tool_class(entry["class_name"], where)
    try:
        with user_call(f"{where}: {entry['class_name']}(config, tool_schema)"):
            return cls(config, entry["tool_schema"])
    except RunAborted:
        raise
    except Exception as exc:  # any failure of a user's constructor: reported as its config's
        raise ToolConfigError(
            f"{where}: {entry['class_name']}(config, tool_schema) failed: "
            f"{describe_user_exception(exc)}"
        ) from exc


def _tool_class(class_name: object, where: str) -> type[Tool]:
    """The :class:`Tool` subclass at dotted path ``class_name``."""
    if not isinstance(class_name, str) or "." not in class_name.strip("."):
        raise ToolConfigError(
            f"{where}: class_name={class_name!r}: expected a dotted path 'package.module.Class'"
        )
    module_name, _, attribute = class_name.rpartition(".")
    try:
        with user_call(f"{where}: import {module_name}"):
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise ToolConfigError(
            f"{where}: class_name={class_name!r}: module {missing!r} not found"
        ) from exc
    except RunAborted:
        raise
    except Exception as exc:  # whatever the user's module raised on import
        raise ToolConfigError(
            f"{where}: class_name={class_name!r}: importing {module_name!r} failed: "
            f"{describe_user_exception(exc)}"
        ) from exc
    cls = getattr(module, attribute, None)
    if cls is None:
        raise ToolConfigError(
            f"{where}: class_name={class_name!r}: module {module_name!r} has no {attribute!r}"
        )
    if not isinstance(cls, type) or not issubclass(cls, Tool):
        raise ToolConfigError(
            f"{where}: class_name={class_name!r} is not a subclass of megarl.agent.tools.base.Tool"
        )
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ToolConfigError(f"{where}: class_name={class_name!r} does not implement {missing}")
    return cls


def check_tool_schema(schema: object, where: str) -> None:
    """Refuse a ``tool_schema`` not in OpenAI function format:
    ``{type: function, function: {name, description?, parameters?}}`` with an object schema."""
    prefix = f"{where}: tool_schema"
    if not isinstance(schema, dict):
        raise ToolConfigError(f"{prefix} must be a mapping, got {type(schema).__name__}")
    if schema.get("type") != "function":
        raise ToolConfigError(f"{prefix}.type={schema.get('type')!r}: must be 'function'")
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ToolConfigError(f"{prefix}.function: missing, or not a mapping")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolConfigError(
            f"{prefix}.function.name={name!r}: must be 1-64 letters, digits, '_' or '-'"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolConfigError(f"{prefix}.function.description: must be a string")
    if "parameters" in function:
        _check_parameters(function["parameters"], f"{prefix}.function.parameters")


def _check_parameters(parameters: object, prefix: str) -> None:
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise ToolConfigError(f"{prefix}: must be a JSON schema of type 'object'")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(spec, Mapping) for spec in properties.values()
    ):
        raise ToolConfigError(f"{prefix}.properties: must map each argument name to a schema")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(key, str) for key in required):
        raise ToolConfigError(f"{prefix}.required: must be a list of argument names")
    undeclared = [key for key in required if key not in properties]
    if undeclared:
        raise ToolConfigError(f"{prefix}.required: {undeclared[0]!r} is not among the properties")

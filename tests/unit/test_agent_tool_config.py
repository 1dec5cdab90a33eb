"""Tool YAML loading: tools built by class path, every mistake one line naming file and entry."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import yaml

from megarl.agent.tool_config import ToolConfigError, load_tools

TOOL_MODULE = """
from megarl.agent.tools.base import Tool


class Echo(Tool):
    async def execute(self, arguments, state):
        return f"{self.config.get('prefix', '')}{arguments['text']}"


class Abstract(Tool):
    pass


class Exploding(Echo):
    def __init__(self, config, tool_schema):
        raise RuntimeError("no sandbox available")


class NotATool:
    pass
"""


@pytest.fixture
def tool_module(tmp_path, monkeypatch) -> str:
    """A module of tool classes, importable for this test only."""
    name = f"megarl_test_tools_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _schema(name="echo", **function) -> dict:
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters, **function}}


def _entry(module: str, cls="Echo", **overrides) -> dict:
    return {"class_name": f"{module}.{cls}", "config": {}, "tool_schema": _schema(), **overrides}


def _write(tmp_path, document, name="tools.yaml"):
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def test_tools_are_built_by_class_path_with_their_config(tmp_path, tool_module):
    path = _write(
        tmp_path,
        textwrap.dedent(
            f"""\
            tools:
              - class_name: {tool_module}.Echo
                config: {{prefix: "> "}}
                tool_schema:
                  type: function
                  function:
                    name: echo
                    description: Repeat the text.
                    parameters:
                      type: object
                      properties: {{text: {{type: string}}}}
                      required: [text]
              - class_name: {tool_module}.Echo
                tool_schema: {{type: function, function: {{name: shout}}}}
            """
        ),
    )
    tools = load_tools(path)
    assert list(tools) == ["echo", "shout"]
    assert tools["echo"].config == {"prefix": "> "} and tools["shout"].config == {}
    assert asyncio.run(tools["echo"].execute({"text": "hi"}, None)) == "> hi"


def _refusal(path) -> str:
    with pytest.raises(ToolConfigError) as caught:
        load_tools(path)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert message.startswith(f"tool config {path}: ")
    return message[len(f"tool config {path}: ") :]


def test_file_level_mistakes(tmp_path):
    assert _refusal(tmp_path / "missing.yaml") == "no such file"
    assert _refusal(_write(tmp_path, "tools: [a, b\n")).startswith(
        "not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)"
    )
    assert (
        _refusal(_write(tmp_path, "- a\n")) == "expected a mapping with a 'tools' list at the top"
    )
    assert _refusal(_write(tmp_path, "tools: []\n")) == (
        "'tools' must be a non-empty list of tool entries"
    )


ENTRY_CASES = [
    (lambda m: "just a string", "expected a mapping with keys class_name, config, tool_schema"),
    (lambda m: _entry(m, tool_schemas={}), "unknown key 'tool_schemas' (the keys are"),
    (lambda m: {"tool_schema": _schema()}, "missing key 'class_name'"),
    (lambda m: {"class_name": f"{m}.Echo"}, "missing key 'tool_schema'"),
    (lambda m: _entry(m, config=[1]), "'config' must be a mapping, got list"),
    (lambda m: _entry(m, class_name="Echo"), "class_name='Echo': expected a dotted path"),
    (
        lambda m: _entry(m, class_name="no_such_pkg.tools.Echo"),
        "class_name='no_such_pkg.tools.Echo': module 'no_such_pkg' not found",
    ),
    (lambda m: _entry(m, cls="Missing"), "module '{m}' has no 'Missing'"),
    (lambda m: _entry(m, cls="NotATool"), "is not a subclass of megarl.agent.tools.base.Tool"),
    (lambda m: _entry(m, cls="Abstract"), "does not implement execute"),
    (
        lambda m: _entry(m, cls="Exploding"),
        "Exploding(config, tool_schema) failed: RuntimeError: no sandbox available",
    ),
    (lambda m: _entry(m, tool_schema=[]), "tool_schema must be a mapping, got list"),
    (
        lambda m: _entry(m, tool_schema={"type": "tool", "function": {}}),
        "tool_schema.type='tool': must be 'function'",
    ),
    (
        lambda m: _entry(m, tool_schema={"type": "function"}),
        "tool_schema.function: missing, or not a mapping",
    ),
    (
        lambda m: _entry(m, tool_schema=_schema(name="read file")),
        "tool_schema.function.name='read file': must be 1-64 letters, digits, '_' or '-'",
    ),
    (
        lambda m: _entry(m, tool_schema=_schema(description=3)),
        "tool_schema.function.description: must be a string",
    ),
    (
        lambda m: _entry(m, tool_schema=_schema(parameters={"type": "string"})),
        "tool_schema.function.parameters: must be a JSON schema of type 'object'",
    ),
    (
        lambda m: _entry(
            m, tool_schema=_schema(parameters={"type": "object", "properties": {"a": 1}})
        ),
        "tool_schema.function.parameters.properties: must map each argument name to a schema",
    ),
    (
        lambda m: _entry(m, tool_schema=_schema(parameters={"type": "object", "required": ["a"]})),
        "tool_schema.function.parameters.required: 'a' is not among the properties",
    ),
]


@pytest.mark.parametrize(("make", "message"), ENTRY_CASES)
def test_entry_mistakes_name_the_entry(tmp_path, tool_module, make, message):
    good = _entry(tool_module, tool_schema=_schema(name="first"))
    path = _write(tmp_path, {"tools": [good, make(tool_module)]})
    refusal = _refusal(path)
    assert refusal.startswith("tools[1]: ")
    assert message.replace("{m}", tool_module) in refusal


def test_duplicate_tool_names_name_both_entries(tmp_path, tool_module):
    path = _write(tmp_path, {"tools": [_entry(tool_module), _entry(tool_module)]})
    assert _refusal(path) == "tools[1]: duplicate tool name 'echo' (also tools[0])"


@pytest.mark.parametrize(
    ("body", "raised"),
    [
        ("raise ImportError('needs docker')", "ImportError: needs docker"),
        ("raise SystemExit(0)", "SystemExit(0)"),  # an exit at import is a bad config, not exit 0
    ],
)
def test_a_module_that_fails_to_import_is_reported(tmp_path, tool_module, body, raised):
    (tmp_path / f"{tool_module}_broken.py").write_text(body + "\n")
    path = _write(tmp_path, {"tools": [_entry(f"{tool_module}_broken")]})
    refusal = _refusal(path)
    assert f"importing '{tool_module}_broken' failed: {raised} (at " in refusal
    assert refusal.endswith(f"{tool_module}_broken.py:1)")

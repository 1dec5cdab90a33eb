"""The tool-call parsers (hermes, Llama-3 JSON): calls, and an error the model can read for
every bad one."""

from __future__ import annotations

import json

import pytest

from megarl.agent.tool_calls import (
    TOOL_FORMATS,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    argument_problems,
    get_tool_format,
    parse_tool_calls,
    render_tools_system_prompt,
)
from megarl.errors import BadInputError


def _schema(name: str, properties: dict, required=(), **extra) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {**parameters, **extra},
        },
    }


TOOLS = {
    "calculator": _schema("calculator", {"expression": {"type": "string"}}, ["expression"]),
    "search": _schema(
        "search",
        {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "score": {"type": "number"},
            "exact": {"type": "boolean"},
            "tags": {"type": "array"},
            "filters": {"type": "object"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "either": {"type": ["string", "null"]},
            "anything": {},
        },
        ["query"],
    ),
    "strict": _schema("strict", {"x": {"type": "integer"}}, additionalProperties=False),
}


def _block(payload) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>\n{body}\n</tool_call>"


def _one_error(text: str) -> str:
    parsed = parse_tool_calls(text, TOOLS)
    assert len(parsed.items) == 1 and not parsed.calls, parsed
    return parsed.errors[0]


def test_no_tool_call_is_plain_content():
    parsed = parse_tool_calls("The answer is 19.", TOOLS)
    assert parsed == ParsedTurn("The answer is 19.", ())
    assert not parsed.has_tool_calls and parsed.calls == () and parsed.errors == ()


def test_one_call_and_the_text_around_it():
    text = "I will compute.\n" + _block({"name": "calculator", "arguments": {"expression": "12+7"}})
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "I will compute."
    assert parsed.items == (ToolCall("calculator", {"expression": "12+7"}),)


def test_two_calls_in_one_turn_keep_their_order():
    text = (
        _block({"name": "search", "arguments": {"query": "x", "limit": 3}})
        + "\n"
        + _block({"name": "calculator", "arguments": {"expression": "1"}})
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert [call.name for call in parsed.calls] == ["search", "calculator"]
    assert parsed.calls[0].arguments == {"query": "x", "limit": 3}
    assert parsed.content == ""


def test_good_and_bad_calls_are_answered_one_by_one():
    text = _block("{oops") + _block({"name": "calculator", "arguments": {"expression": "1"}})
    parsed = parse_tool_calls(text, TOOLS)
    assert isinstance(parsed.items[0], ToolCallError)
    assert parsed.items[1] == ToolCall("calculator", {"expression": "1"})
    assert parsed.errors[0].startswith("tool call 1: malformed JSON")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1"}', "tool call 1: malformed JSON"),
        ("[1, 2]", "tool call 1: expected a JSON object"),
        ('{"arguments": {}}', 'tool call 1: no "name" (a string)'),
        ('{"name": 3}', 'tool call 1: no "name" (a string)'),
        (
            '{"name": "python", "arguments": {}}',
            "tool call 1: unknown tool 'python' (the tools are: calculator, search, strict)",
        ),
        (
            '{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}',
            'tool call 1 (calculator): "arguments" must be a JSON object, got a string',
        ),
        (
            '{"name": "calculator", "arguments": {}}',
            "tool call 1 (calculator): missing required argument 'expression'",
        ),
        (
            '{"name": "calculator"}',
            "tool call 1 (calculator): missing required argument 'expression'",
        ),
    ],
)
def test_malformed_calls_get_a_readable_error(body, message):
    assert _one_error(_block(body)).startswith(message)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"query": 3}, "argument 'query' must be of type string, got an integer (3)"),
        ({"query": "q", "limit": 1.5}, "argument 'limit' must be of type integer, got a number"),
        ({"query": "q", "limit": True}, "argument 'limit' must be of type integer, got a boolean"),
        ({"query": "q", "score": "high"}, "argument 'score' must be of type number, got a string"),
        ({"query": "q", "exact": "yes"}, "argument 'exact' must be of type boolean, got a string"),
        ({"query": "q", "tags": "a,b"}, "argument 'tags' must be of type array, got a string"),
        ({"query": "q", "filters": [1]}, "argument 'filters' must be of type object, got an array"),
        ({"query": "q", "unit": "k"}, 'argument \'unit\' must be one of "c", "f", got "k"'),
        ({"query": "q", "either": 1}, "argument 'either' must be of type string or null"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(arguments, message):
    error = _one_error(_block({"name": "search", "arguments": arguments}))
    assert error.startswith("tool call 1 (search): ")
    assert message in error


def test_arguments_that_fit_the_schema_pass():
    arguments = {
        "query": "q",
        "limit": 3.0,  # JSON Schema: an integer-valued number is an integer
        "score": 2,
        "exact": False,
        "tags": [],
        "filters": {},
        "unit": "c",
        "either": None,
        "anything": [1, "x"],
        "undeclared": 1,  # allowed unless additionalProperties is false
    }
    parsed = parse_tool_calls(_block({"name": "search", "arguments": arguments}), TOOLS)
    assert parsed.calls == (ToolCall("search", arguments),)


def test_every_problem_of_a_call_is_listed_and_extra_arguments_refused_when_strict():
    error = _one_error(_block({"name": "strict", "arguments": {"x": "1", "y": 2}}))
    assert error == (
        "tool call 1 (strict): argument 'x' must be of type integer, got a string (\"1\"); "
        "unexpected argument 'y' (the arguments are: x)"
    )
    assert argument_problems({}, {}) == []


@pytest.mark.parametrize(
    ("text", "items", "message"),
    [
        ('<tool_call>\n{"name": "calculator"', 1, "tool call 1: <tool_call> is not closed"),
        (
            '<tool_call>{"a": 1}<tool_call>{"b": 2}</tool_call>',
            2,
            "tool call 1: <tool_call> is not",
        ),
        ('{"name": "calculator"}</tool_call>', 1, "tool call 1: </tool_call> without an opening"),
    ],
)
def test_unclosed_and_stray_tags_are_errors(text, items, message):
    parsed = parse_tool_calls(text, TOOLS)
    assert len(parsed.items) == items
    assert parsed.errors[0].startswith(message)


def test_an_unclosed_tag_after_a_good_call_keeps_the_call():
    text = _block({"name": "calculator", "arguments": {"expression": "1"}}) + "\n<tool_call>\n{"
    parsed = parse_tool_calls(text, TOOLS)
    assert len(parsed.calls) == 1
    assert parsed.errors == ("tool call 2: <tool_call> is not closed by </tool_call>",)


def test_the_system_prompt_lists_the_schemas_and_the_calling_convention():
    schemas = [TOOLS["calculator"], TOOLS["search"]]
    prompt = render_tools_system_prompt(schemas)
    assert prompt.startswith("# Tools\n")
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == schemas
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in prompt
    )
    assert "<tool_response>" in prompt
    hermes = get_tool_format("hermes")
    assert hermes.results_text(["19", "20"]) == (
        "<tool_response>\n19\n</tool_response>\n<tool_response>\n20\n</tool_response>"
    )


def test_an_unknown_tool_format_is_bad_input_naming_the_key():
    assert set(TOOL_FORMATS) == {"hermes", "llama3_json"}
    with pytest.raises(BadInputError) as caught:
        get_tool_format("pythonic")
    assert str(caught.value) == (
        "rollout.agent.tool_format='pythonic': must be one of hermes, llama3_json"
    )
    assert caught.value.exit_code == 2


def _llama3(text: str) -> ParsedTurn:
    return parse_tool_calls(text, TOOLS, "llama3_json")


def test_llama3_json_calls_are_the_whole_turn():
    one = _llama3('{"name": "calculator", "parameters": {"expression": "12 + 7"}}')
    assert one == ParsedTurn("", (ToolCall("calculator", {"expression": "12 + 7"}),))
    tagged = _llama3('<|python_tag|>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert tagged.calls == (ToolCall("calculator", {"expression": "1"}),)
    two = _llama3(
        '{"name": "calculator", "parameters": {"expression": "1"}}; '
        '{"name": "search", "parameters": {"query": "q"}}'
    )
    assert [c.name for c in two.calls] == ["calculator", "search"]
    assert _llama3("The answer is 19.") == ParsedTurn("The answer is 19.")
    after = _llama3('{"name": "calculator", "parameters": {"expression": "1"}} and some words')
    assert after.content == "and some words" and len(after.calls) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"name": "calculator", "parameters": {"expression": ', "tool call 1: malformed JSON"),
        ('{"name": "weather", "parameters": {}}', "unknown tool 'weather'"),
        ('{"name": "calculator", "parameters": {"expression": 3}}', "must be of type string"),
        ('{"name": "calculator", "parameters": "12"}', '"parameters" must be a JSON object'),
        ('{"parameters": {}}', 'no "name"'),
    ],
)
def test_llama3_json_mistakes_are_errors_for_the_model(text, message):
    parsed = _llama3(text)
    assert not parsed.calls and len(parsed.errors) == 1 and message in parsed.errors[0]


def test_llama3_json_describes_tools_and_results_for_templates_without_tools():
    fmt = get_tool_format("llama3_json")
    prompt = fmt.system_prompt([TOOLS["calculator"]])
    assert '{"name": function name, "parameters": dictionary' in prompt
    assert json.dumps(TOOLS["calculator"]) in prompt
    lines = fmt.results_text(["19", 'a "quoted" result']).splitlines()
    assert [json.loads(line) for line in lines] == [
        {"output": "19"},
        {"output": 'a "quoted" result'},
    ]

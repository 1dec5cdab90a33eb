"""The calculator tool: exact arithmetic, and every hostile input a readable ToolError in
milliseconds (no eval, no huge numbers, no deep recursion)."""

from __future__ import annotations

import asyncio
import time

import pytest

from megarl.agent.tools.base import ToolError
from megarl.agent.tools.calculator import (
    CALCULATOR_SCHEMA,
    CalculatorTool,
    evaluate,
    format_number,
)


def calc(expression: object) -> str:
    tool = CalculatorTool()
    return asyncio.run(tool.execute({"expression": expression}, None))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2**10", "1024"),
        ("-3**2", "-9"),
        ("(-3)**2", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("10 % 3", "1"),
        ("6 / 3", "2"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333333"),
        ("2 ** 0.5", "1.4142135623731"),
        ("2 ** -1", "0.5"),
        ("sqrt(16)", "4"),
        ("abs(-2.5)", "2.5"),
        ("round(2.567, 2)", "2.57"),
        ("round(2.5)", "2"),
        ("max(1, 5, 3)", "5"),
        ("min(4, -1.5)", "-1.5"),
        ("floor(-2.5) + ceil(2.1)", "0"),
        ("log(e)", "1"),
        ("log(8, 2)", "3"),
        ("log10(1000)", "3"),
        ("factorial(20)", "2432902008176640000"),
        ("2 * pi", "6.28318530717959"),
        ("+5", "5"),
        ("-0.0", "0"),
        ("1e20", "1e+20"),
        ("10**30", "1" + "0" * 30),
        ("  3 +\t4 ", "7"),
    ],
)
def test_arithmetic(expression: str, expected: str) -> None:
    assert calc(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9", "too large"),
        ("2**100000", "too large"),
        ("(-7)**99999", "too large"),
        ("10**999 * 10**999", "too large"),
        ("factorial(100000)", "factorial"),
        ("factorial(1000)", "too large"),
        ("factorial(2.5)", "whole number"),
        ("1e308 * 10", "too large"),
        ("1e999", "too large"),
        ("exp(1000)", "too large"),
        ("sqrt(10**400)", "too large"),
        ("round(1.5, 10**9)", "round"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("sqrt(-1)", "math error"),
        ("log(0)", "math error"),
        ("(-8) ** (1/3)", "not a real number"),
        ("2 ^ 3", "use **"),
        ("1 << 1000000", "not supported"),
        ("__import__('os').system('id')", "unknown function"),
        ("(1).real", "Attribute"),
        ("x + 1", "unknown name"),
        ("True + 1", "not a real number"),
        ("'a' * 3", "not a real number"),
        ("1j * 2", "not a real number"),
        ("[1, 2]", "List"),
        ("lambda: 1", "Lambda"),
        ("1 if 1 else 2", "IfExp"),
        ("1 < 2", "Compare"),
        ("round(number=2.5)", "positional"),
        ("max(*[1, 2])", "positional"),
        ("sqrt()", "1 arguments"),
        ("sqrt(1, 2)", "1 arguments"),
        ("2(3)", "unknown function"),
        ("", "empty"),
        ("1 +", "cannot parse"),
        ("1" * 2000, "characters long"),
        ("(" * 300 + "1" + ")" * 300, "cannot parse"),
        ("-" * 500 + "1", "nested more than"),
        ("2**" * 200 + "2", "nested more than"),
        ("+".join(["1"] * 400), "nested more than"),
    ],
)
def test_refused_with_reason_fast(expression: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ToolError, match="calculator") as info:
        calc(expression)
    assert message in str(info.value)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("arguments", [{}, {"expression": 3}, {"expr": "1+1"}, None])
def test_bad_arguments(arguments: object) -> None:
    with pytest.raises(ToolError, match="expression"):
        asyncio.run(CalculatorTool().execute(arguments, None))  # type: ignore[arg-type]


def test_never_evals(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert evaluate("2 + 2") == 4


def test_format_number() -> None:
    assert format_number(3) == "3"
    assert format_number(3.0) == "3"
    assert format_number(1e15) == "1e+15"
    assert format_number(-1.25) == "-1.25"
    assert format_number(1e-20) == "1e-20"


def test_default_schema_and_name() -> None:
    tool = CalculatorTool()
    assert tool.name == "calculator"
    assert tool.tool_schema == CALCULATOR_SCHEMA
    assert tool.tool_schema is not CALCULATOR_SCHEMA  # a copy: callers may edit theirs
    assert CALCULATOR_SCHEMA["function"]["parameters"]["required"] == ["expression"]

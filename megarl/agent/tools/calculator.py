"""``calculator``: exact arithmetic for the model, without running its text as code.

The expression is parsed with :mod:`ast` and walked over a whitelist (numbers, ``+ - * / // %
**``, unary signs, parentheses, a few :mod:`math` functions and ``pi``/``e``); nothing is ever
passed to ``eval``. Each step is bounded before it is computed, so that hostile input fails in
microseconds with a message the model can act on: ``9**9**9`` would need gigabytes of digits,
``factorial(10**9)`` minutes, a 100 kB expression or 10,000 nested parentheses a deep parser
recursion. Every failure is a :class:`ToolError`.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from collections.abc import Callable
from typing import Any

from megarl.agent.tools.base import Tool, ToolError

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression exactly and return the number. Supports + - * / "
            "// % ** (power; not ^), parentheses, pi, e and sqrt, abs, round, min, max, floor, "
            "ceil, exp, log (natural, or log(x, base)), log2, log10, sin, cos, tan, factorial. "
            "Example: (3 + 4.5) * 2**10 / sqrt(2)"
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression to evaluate."},
            },
            "required": ["expression"],
        },
    },
}

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 100  # nested operations; a left-to-right sum of 100 terms is 100 deep
MAX_INT_DIGITS = 1000
_MAX_INT_BITS = math.ceil(MAX_INT_DIGITS * math.log2(10))
MAX_FACTORIAL = 1000
MAX_ROUND_DIGITS = 1000

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _factorial(n: Number) -> int:
    if isinstance(n, float):
        if not n.is_integer():
            raise ToolError("factorial() needs a whole number")
        n = int(n)
    if not 0 <= n <= MAX_FACTORIAL:
        raise ToolError(f"factorial() needs 0 <= n <= {MAX_FACTORIAL}")
    return math.factorial(n)


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
        raise ToolError(f"round(x, n) needs a whole n with |n| <= {MAX_ROUND_DIGITS}")
    return round(x, ndigits)


def _min(*args: Number) -> Number:
    return min(args)


def _max(*args: Number) -> Number:
    return max(args)


# name: (function, fewest arguments, most arguments)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "min": (_min, 1, 100),
    "max": (_max, 1, 100),
    "sqrt": (math.sqrt, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "log": (math.log, 1, 2),
    "log2": (math.log2, 1, 1),
    "log10": (math.log10, 1, 1),
    "sin": (math.sin, 1, 1),
    "cos": (math.cos, 1, 1),
    "tan": (math.tan, 1, 1),
    "factorial": (_factorial, 1, 1),
}


def evaluate(expression: str) -> Number:
    """The value of ``expression``; :class:`ToolError` with the reason when it has none."""
    if not isinstance(expression, str):
        raise ToolError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(
            f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS}"
        )
    if not expression.strip():
        raise ToolError("the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        hint = " (use ** for powers)" if "^" in expression else ""
        raise ToolError(f"cannot parse {expression!r:.100}: {type(e).__name__}{hint}") from None
    return _check(_Evaluator().visit(tree.body, 0))


class _Evaluator:
    """Walks the whitelisted nodes; anything else is refused by name."""

    def visit(self, node: ast.AST, depth: int) -> Number:
        if depth > MAX_DEPTH:
            raise ToolError(f"the expression is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, ast.Constant):
            return self._constant(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = self.visit(node.operand, depth + 1)
            return -value if isinstance(node.op, ast.USub) else +value
        if isinstance(node, ast.BinOp):
            return self._binary(node, depth)
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise ToolError(f"unknown name {node.id!r}; known: {sorted(_CONSTANTS)}")
        if isinstance(node, ast.Call):
            return self._call(node, depth)
        raise ToolError(
            f"{type(node).__name__} is not arithmetic; only numbers and + - * / // % **"
        )

    @staticmethod
    def _constant(node: ast.Constant) -> Number:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ToolError(f"{value!r:.50} is not a real number")
        return _check(value)

    def _binary(self, node: ast.BinOp, depth: int) -> Number:
        op = _BINARY.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise ToolError(f"operator {type(node.op).__name__} is not supported{hint}")
        left = self.visit(node.left, depth + 1)
        right = self.visit(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
        return _apply(op, left, right)

    def _call(self, node: ast.Call, depth: int) -> Number:
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in _FUNCTIONS:
            shown = name or type(node.func).__name__
            raise ToolError(f"unknown function {shown!r}; known: {sorted(_FUNCTIONS)}")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ToolError(f"{name}() takes positional numbers only")
        function, fewest, most = _FUNCTIONS[name]
        if not fewest <= len(node.args) <= most:
            count = str(fewest) if fewest == most else f"{fewest} to {most}"
            raise ToolError(f"{name}() takes {count} arguments, got {len(node.args)}")
        args = [self.visit(a, depth + 1) for a in node.args]
        return _apply(function, *args)


def _apply(function: Callable[..., Any], *args: Number) -> Number:
    try:
        result = function(*args)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("the result is too large") from None
    except (ValueError, TypeError) as e:
        raise ToolError(f"math error: {e}") from None
    if isinstance(result, complex):
        raise ToolError("the result is not a real number")
    return _check(result)


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse an integer power whose result has more than MAX_INT_DIGITS digits before it
    is computed (``9**9**9`` has 370 million); float powers overflow on their own."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        _check_bits(exponent * (abs(base).bit_length() - 1))


def _check_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS + 1:
        raise ToolError(f"the result is too large (more than {MAX_INT_DIGITS} digits)")


def _check(value: Number) -> Number:
    if isinstance(value, int):
        _check_bits(value.bit_length())
    elif not math.isfinite(value):
        raise ToolError("the result is too large or undefined")
    return value


def format_number(value: Number) -> str:
    """Integers exactly; floats to 15 significant digits, which hides binary noise
    (0.1 + 0.2 is ``0.3``) and shows a whole float as an integer (7 / 7 is ``1``)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.15g}"
    return "0" if text == "-0" else text


class CalculatorTool(Tool):
    """Evaluates the model's ``expression`` argument; the observation is the number."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config or {}, tool_schema or copy.deepcopy(CALCULATOR_SCHEMA))

    async def execute(self, arguments: dict[str, Any], state: Any) -> str:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if not isinstance(expression, str):
            raise ToolError(
                f"{self.name}: expected a string argument 'expression', got {arguments!r:.200}"
            )
        try:
            return format_number(evaluate(expression))
        except ToolError as e:
            raise ToolError(f"{self.name}: {e}") from None

"""A calculator agent written with the plain ``openai`` SDK, trained unmodified by megarl.

Nothing here knows about megarl: the agent talks to whatever OpenAI-compatible endpoint it is
given and runs its tool in its own code, as agent frameworks do. megarl calls ``solve`` once per
sample with the dataset row and a session of its gateway (``llm.base_url``), records the tokens
the policy sampled, and trains them:

    megarl-train recipe=gsm8k_openai_agent        # or examples/gateway_calculator.sh

To try the agent against a model without training, start a gateway over an engine
(``megarl.agent.gateway.serve``) and call ``solve`` with its URL (see docs/agents.md).
"""

from __future__ import annotations

import ast
import json
import operator

import openai

SYSTEM = (
    "You solve grade-school math problems. Use the calculator tool for every computation, "
    'then give the final number after "####".'
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 4

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The expression's value, by walking its syntax tree (no ``eval``: the model wrote it)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"Error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def solve(row, llm):
    """Ask, run the calculator for every call the model makes, ask again; at most
    ``MAX_TURNS`` model turns. Returns None: the dataset's reward scores the last answer."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    question = [m for m in row["prompt"] if m["role"] != "system"]
    messages = [{"role": "system", "content": SYSTEM}, *question]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=llm.model, messages=messages, tools=[CALCULATOR], max_tokens=192
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason == "length":
            return
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))}
            )
    return

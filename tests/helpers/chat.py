"""Chat fixtures the rendering, SFT and gateway tests share: a short calculator tool schema, an
assistant turn that calls a tool."""

from __future__ import annotations

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""An OpenAI-format tool schema, shorter than the built-in calculator's (rendered prompts stay
short)."""


def tool_call_message(name: str, arguments: str, call_id: str = "c1") -> dict:
    """An assistant turn that calls one tool, in OpenAI's chat format as clients send it and
    datasets store it (no content, the arguments a JSON string); the tool's answer names
    ``call_id``."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}

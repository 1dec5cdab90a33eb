"""Chat fixtures the rendering and SFT tests share: a short calculator tool schema."""

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

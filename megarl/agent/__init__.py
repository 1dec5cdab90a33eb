"""Agentic RL: multi-turn rollouts with tools, token-in/token-out.

A loop builds a :class:`Trajectory` from the ids the engine sampled (:class:`GenerateOutput`)
and the ids of what the environment answered; tools are :class:`Tool` subclasses named in a
verl-style tool YAML (:mod:`megarl.agent.tool_config`); :mod:`megarl.agent.tool_calls` reads the
model's calls and :mod:`megarl.agent.render` renders the results exactly as the chat template
does. Importing this package imports no torch.
"""

from megarl.agent.driver import AgentContext
from megarl.agent.loop import AgentLoop, AgentSettings, Sample
from megarl.agent.tools.base import Tool, ToolError
from megarl.agent.trajectory import GenerateOutput, Trajectory

__all__ = [
    "AgentContext",
    "AgentLoop",
    "AgentSettings",
    "GenerateOutput",
    "Sample",
    "Tool",
    "ToolError",
    "Trajectory",
]

"""Prompts, datasets and rewards for the GRPO trainer (pure Python, no torch).

The trainer builds a prompt source from the ``data.*`` config, wraps it in a
:class:`PromptStream` that it checkpoints with the model, and scores each response with a
reward function looked up by name.
"""

from megarl.data.arithmetic import ArithmeticTask
from megarl.data.errors import DatasetError
from megarl.data.jsonl import load_jsonl_problems
from megarl.data.loader import PromptSource, PromptStream, build_prompt_source
from megarl.data.problems import Problem
from megarl.data.rewards import (
    REWARD_FNS,
    exact_match_last_number,
    extract_last_number,
    get_reward_fn,
    gsm8k_reward,
)

__all__ = [
    "REWARD_FNS",
    "ArithmeticTask",
    "DatasetError",
    "Problem",
    "PromptSource",
    "PromptStream",
    "build_prompt_source",
    "exact_match_last_number",
    "extract_last_number",
    "get_reward_fn",
    "gsm8k_reward",
    "load_jsonl_problems",
]

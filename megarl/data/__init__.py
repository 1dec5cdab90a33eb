"""Prompts, datasets and rewards for the GRPO trainer (pure Python, no torch).

The trainer builds a prompt source from the ``data.*`` config, wraps it in a
:class:`PromptStream` that it checkpoints with the model, and scores each response with a
reward function chosen by name or by each row's ``data_source``.
"""

from megarl.data.arithmetic import ArithmeticTask
from megarl.data.errors import DatasetError
from megarl.data.jsonl import load_jsonl_problems
from megarl.data.loader import PromptSource, PromptStream, build_prompt_source
from megarl.data.problems import Problem
from megarl.data.rewards import (
    BUILTIN_REWARDS,
    DATA_SOURCE_REWARDS,
    Reward,
    RewardChoice,
    choose_reward,
    exact_match_last_number,
    extract_last_number,
    get_reward_fn,
    gsm8k_reward,
    math_reward,
)

__all__ = [
    "BUILTIN_REWARDS",
    "DATA_SOURCE_REWARDS",
    "ArithmeticTask",
    "DatasetError",
    "Problem",
    "PromptSource",
    "PromptStream",
    "Reward",
    "RewardChoice",
    "build_prompt_source",
    "choose_reward",
    "exact_match_last_number",
    "extract_last_number",
    "get_reward_fn",
    "gsm8k_reward",
    "load_jsonl_problems",
    "math_reward",
]

"""The prompts and their scores: the ``data`` section (the task or dataset files, validation
data, the reward function and what happens when it fails) and the ``reward`` section (shaping
of the scores before the advantages: DAPO's overlong buffer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from megarl.config.checks import ConfigError, _choice, _optional_positive, _positive, _require
from megarl.data.arithmetic import SUPPORTED_OPS
from megarl.data.loader import PROMPT_TASKS
from megarl.data.rewards import (
    BUILTIN_REWARDS,
    REWARD_ERROR_POLICIES,
    RewardChoice,
    RewardComponent,
    WeightedReward,
    choose_reward,
    choose_rewards,
    parse_reward_components,
)


def _file_list(key: str, value: object) -> tuple[str, ...] | None:
    """None, or one file / a list of files as a tuple (verl's ``data.train_files`` form)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    _require(
        isinstance(value, list | tuple) and all(isinstance(f, str) for f in value),
        f"{key}={value!r}: expected a file or a list of files",
    )
    return tuple(cast("list[str]", value))


@dataclass(frozen=True)
class DataConfig:
    """``data``: the prompts (the built-in arithmetic task, a jsonl file or verl-style dataset
    files), validation data, and the reward function that scores the responses."""

    task: str = "auto"
    """auto (files when ``train_files`` is set, jsonl when ``path`` is, else arithmetic) |
    arithmetic (built-in, seeded) | jsonl (GSM8K-style rows: question, answer with #### N) |
    files (``train_files`` in verl's row schema, see :mod:`megarl.data.files`). Resolved at
    construction, so it is never auto afterwards."""
    path: str | None = None
    """``task=jsonl``: a file of GSM8K-style rows, ``{"question": ..., "answer": "... #### 42"}``."""
    train_files: tuple[str, ...] | None = None
    """verl's key: one file or a list (.parquet, .jsonl, .json)."""
    prompt_key: str = "prompt"
    """The column holding the prompt: chat messages or a string (verl's key)."""
    answer_key: str | None = None
    """The column holding the answer; None = verl's ``reward_model.ground_truth``."""
    max_prompt_length: int | None = None
    """verl's key: the most tokens a prompt (chat template included) may have; None = what the
    context leaves after ``rollout.max_new_tokens``."""
    filter_overlong_prompts: bool = False
    """verl's key: drop the dataset's prompts over that budget at load time (counted on the
    console) instead of refusing the run."""
    val_files: tuple[str, ...] | None = None
    """Held-out problems (same formats and keys as ``train_files``) for validation."""
    val_problems: int = 32
    """The built-in arithmetic task's held-out problems: never trained on, and what validation
    runs on when ``val_files`` is unset. 0 = none (the training stream is then the one of
    earlier versions)."""
    val_batch_size: int | None = None
    """Validation prompts per engine call; None = all at once."""
    prompts_per_step: int = 4
    """Prompts per step; each gets ``rollout.n`` samples."""
    max_operand: int = 20
    """The built-in arithmetic task: operands are drawn from 1 to this."""
    ops: tuple[str, ...] = ("+",)
    """The built-in arithmetic task: the operators its problems use."""
    reward: str | tuple[RewardComponent, ...] = "auto"
    """auto (exact_last_number for arithmetic; for a dataset, each row's ``data_source``
    picks: GSM8K sources gsm8k, MATH sources math, rows without one gsm8k; see
    :data:`megarl.data.rewards.DATA_SOURCE_REWARDS`) | exact_last_number | gsm8k (the number
    after the last ``####``, else the last number) | math (the last ``\\boxed{}``, compared by
    math-verify) | exact_match | package.module:function (your own
    ``(response, answer) -> float``; it gets the dataset's answer text as it is) | a list of
    several, each ``{name, fn, weight}`` (``fn`` one of the above; ``name`` default ``fn``,
    ``weight`` default 1): every function scores every sample, the reward is their weighted
    sum (``algo.adv_estimator=gdpo`` normalises each apart), each logged as
    ``reward/<name>/mean``; the first is the primary one, which validation reports and whose
    needs (numeric answers) the dataset's rows are read with."""
    reward_error: str = "raise"
    """One of :data:`megarl.data.rewards.REWARD_ERROR_POLICIES`. A reward function that raises
    or returns anything but one finite number (None, NaN, a string, a list): raise (stop the
    run with one line naming the function and the sample, exit 2) | zero (score that sample
    0.0, warn once, count them in ``critic/rewards/failed``)."""
    reward_timeout_s: float | None = None
    """Wall-clock limit of one call of your own reward function (``package.module:function``;
    the built-in ones are bounded themselves): past it the call is that function's failure,
    handled by ``reward_error``, never a hang (a stuck network call). The function then runs in
    a thread of its own, which libraries that time themselves with ``signal.alarm`` refuse
    (math-verify: pass ``parsing_timeout=None``), hence off by default. null = no limit."""
    instruction: str = ""
    """Appended to every jsonl question."""
    system_prompt: str | None = None
    """None keeps the tokenizer's default system prompt."""
    messages_key: str = "messages"
    """``algo.objective=sft``: the column of OpenAI chat messages (multi-turn, ``tool_calls``
    and ``tool`` messages); rows without it use ``prompt_key`` and ``response_key``."""
    response_key: str = "response"
    """``algo.objective=sft``: the column of the answer to ``prompt_key``'s prompt."""
    tools_key: str = "tools"
    """``algo.objective=sft``: the optional column of the row's OpenAI tool schemas."""
    max_length: int | None = None
    """``algo.objective=sft`` (verl's key): the longest conversation in tokens; null = the
    model's context. Longer rows are bad rows."""
    skip_bad_rows: bool = False
    """``algo.objective=sft``: false = a bad row (no assistant turn, too long, a tool call
    whose arguments are not JSON) stops the start in one line naming ``file:row``; true = such
    rows are left out, counted, and said at start-up."""

    def __post_init__(self) -> None:
        files = _file_list("data.train_files", self.train_files)
        object.__setattr__(self, "train_files", files)
        object.__setattr__(self, "val_files", _file_list("data.val_files", self.val_files))
        _optional_positive("data.val_batch_size", self.val_batch_size)
        _optional_positive("data.max_prompt_length", self.max_prompt_length)
        if self.task == "auto":
            task = "files" if files else ("jsonl" if self.path else "arithmetic")
            object.__setattr__(self, "task", task)
        _choice("data.task", self.task, PROMPT_TASKS)
        _require(
            self.task != "jsonl" or bool(self.path), "data.path must be set for data.task=jsonl"
        )
        _require(
            self.task != "files" or bool(self.train_files),
            "data.train_files must name at least one file for data.task=files",
        )
        _positive("data.prompts_per_step", self.prompts_per_step)
        _require(self.max_operand >= 1, f"data.max_operand={self.max_operand}: must be >= 1")
        _require(self.val_problems >= 0, f"data.val_problems={self.val_problems}: must be >= 0")
        _require(bool(self.ops), f"data.ops: empty; choose from {', '.join(SUPPORTED_OPS)}")
        for op in self.ops:
            _choice("data.ops", op, SUPPORTED_OPS)
        if isinstance(self.reward, str):
            if ":" not in self.reward:
                _choice("data.reward", self.reward, ("auto", *BUILTIN_REWARDS))
        else:
            try:
                components = parse_reward_components(self.reward)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            object.__setattr__(self, "reward", components)
        _choice("data.reward_error", self.reward_error, REWARD_ERROR_POLICIES)
        _optional_positive("data.reward_timeout_s", self.reward_timeout_s)
        _optional_positive("data.max_length", self.max_length)

    @property
    def reward_components(self) -> tuple[RewardComponent, ...] | None:
        """``data.reward``'s functions in its list form; None for the one-function form."""
        return None if isinstance(self.reward, str) else self.reward

    @property
    def reward_choice(self) -> RewardChoice:
        """``data.reward`` resolved (``auto``: by each row's ``data_source``); of a list, the
        first (primary) function."""
        reward = self.reward
        return choose_reward(reward if isinstance(reward, str) else reward[0].fn, self.task)

    @property
    def weighted_rewards(self) -> tuple[WeightedReward, ...] | None:
        """The list form resolved (each function, name and weight); None for one function."""
        components = self.reward_components
        return None if components is None else choose_rewards(components, self.task)


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: see :func:`megarl.algo.dapo.overlong_penalty`."""

    enable: bool = False
    """Penalise responses that run into the last ``len`` tokens before the limit."""
    len: int | None = None
    """The last this-many tokens before ``rollout.max_new_tokens`` where the penalty grows;
    None = a fifth of ``rollout.max_new_tokens`` (DAPO's 4096 of 20480)."""
    penalty_factor: float = 1.0
    """The penalty of a response that used every allowed token."""

    def __post_init__(self) -> None:
        _optional_positive("reward.overlong_buffer.len", self.len)
        _require(
            self.penalty_factor >= 0,
            f"reward.overlong_buffer.penalty_factor={self.penalty_factor}: must be >= 0",
        )


@dataclass(frozen=True)
class RewardConfig:
    """Shaping applied to the reward function's scores before advantages."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

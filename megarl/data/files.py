"""Prompt datasets in verl's row schema (``data.train_files``): parquet, JSONL, JSON files, and
folders written by Hugging Face ``datasets``' ``save_to_disk``.

verl's preprocessing scripts write one row per problem::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # chat messages (or a string)
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...}}

so a dataset prepared for verl trains here as it is. Flat rows work too: ``data.prompt_key``
names the prompt column and ``data.answer_key`` the answer column (a GSM8K-style
``"... #### 72"`` answer is reduced to its final number). Parquet is read with pyarrow; every
row is checked when the file is loaded, and the first bad one is reported as ``file:row``
(1-based), so a silently shrunken dataset cannot happen.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from megarl.data.errors import DatasetError
from megarl.data.jsonl import FINAL_ANSWER_MARKER, parse_final_answer
from megarl.data.numbers import normalize_number
from megarl.data.problems import Problem
from megarl.data.rewards import Reward, RewardChoice, choose_reward

FILE_SUFFIXES: tuple[str, ...] = (".parquet", ".jsonl", ".json")
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")


def load_problem_files(
    paths: str | Sequence[str],
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    instruction: str = "",
    reward: RewardChoice | None = None,
) -> list[Problem]:
    """Every row of every file, in order, as :class:`Problem` s.

    Args:
        paths: One file or a list (``data.train_files``).
        prompt_key: The column holding the prompt: chat messages or a string.
        answer_key: The column holding the answer; None = verl's ``reward_model.ground_truth``.
        instruction: Appended to the last user message (e.g. how to format the answer).
        reward: How the rows are scored (``data.reward``); a row whose ``data_source`` has
            no reward, or whose answer is not a number for a reward that compares numbers, is
            refused here. None = ``data.reward=auto``.

    Raises:
        DatasetError: a file is missing, unreadable or empty, or a row is malformed; the
            message names ``file:row``.
    """
    files = [paths] if isinstance(paths, str) else list(paths)
    if not files:
        raise DatasetError("data.train_files: no file named")
    choice = reward if reward is not None else choose_reward("auto", task="files")
    problems: list[Problem] = []
    for path in files:
        rows = 0
        for location, row in read_rows(str(path)):
            problems.append(_to_problem(row, location, prompt_key, answer_key, instruction, choice))
            rows += 1
        if rows == 0:
            raise DatasetError(f"{path}: dataset has no rows")
    return problems


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """``(file:row, row)`` for each row; rows are counted from 1 as an editor or pandas shows
    them (+1)."""
    suffix = Path(path).suffix.lower()
    if os.path.isdir(path):
        rows: Iterable[object] = _saved_dataset_rows(path)
    elif suffix not in FILE_SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported dataset file type {suffix or '(none)'!r}; "
            f"use one of {', '.join(FILE_SUFFIXES)} or a datasets save_to_disk folder"
        )
    elif not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset file does not exist")
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    elif suffix == ".jsonl":
        rows = _jsonl_rows(path)
    else:
        rows = _json_rows(path)
    for number, row in enumerate(rows, start=1):
        location = f"{path}:{number}"
        if not isinstance(row, dict):
            raise DatasetError(f"{location}: row is a {type(row).__name__}, expected an object")
        yield location, row


def _saved_dataset_rows(path: str) -> list[object]:
    """The rows of a folder written by Hugging Face ``datasets``' ``save_to_disk`` (one split)."""
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise DatasetError(
            f"{path}: a dataset folder needs the datasets package (pip install datasets)"
        ) from None
    try:
        data = load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as exc:
        detail = " ".join(str(exc).split())[:160]
        raise DatasetError(
            f"{path}: not a dataset folder written by datasets' save_to_disk ({detail})"
        ) from None
    if isinstance(data, DatasetDict):
        splits = [str(split) for split in data]
        raise DatasetError(
            f"{path}: holds the splits {', '.join(splits)}; name one split's folder, e.g. "
            f"{os.path.join(path, splits[0]) if splits else path}"
        )
    return data.to_list()


def _parquet_rows(path: str) -> list[object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None


def _text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: dataset file is not valid UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset file ({exc.strerror})") from None


def _jsonl_rows(path: str) -> Iterator[object]:
    for number, line in enumerate(_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: invalid JSON ({exc.msg})") from None


def _json_rows(path: str) -> list[object]:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of row objects")
    return data


def _to_problem(
    row: Mapping[str, object],
    location: str,
    prompt_key: str,
    answer_key: str | None,
    instruction: str,
    choice: RewardChoice,
) -> Problem:
    messages = _messages(row, location, prompt_key)
    if instruction:
        role, content = messages[-1]
        messages = (*messages[:-1], (role, f"{content} {instruction}"))
    data_source = row.get("data_source")
    data_source = data_source if isinstance(data_source, str) else ""
    try:
        reward = choice.for_source(data_source)
    except ValueError as exc:
        raise DatasetError(f"{location}: {exc}") from None
    agent_name, tools_kwargs = _agent_fields(row, location)
    return Problem(
        prompt=messages[-1][1],
        answer=_answer(row, location, answer_key, reward),
        source=location,
        messages=messages,
        data_source=data_source,
        agent_name=agent_name,
        tools_kwargs=tools_kwargs,
    )


def _agent_fields(row: Mapping[str, object], location: str) -> tuple[str, dict[str, Any]]:
    """verl's multi-turn columns: ``agent_name`` and ``extra_info.tools_kwargs`` (a mapping of
    tool name to that tool's mapping), checked here so a bad row is named before training."""
    agent_name = row.get("agent_name")
    if agent_name is None:
        agent_name = ""
    if not isinstance(agent_name, str):
        raise DatasetError(
            f"{location}: 'agent_name' must be a string (a loop name or class path), "
            f"got {type(agent_name).__name__}"
        )
    extra = row.get("extra_info")
    kwargs = extra.get("tools_kwargs") if isinstance(extra, Mapping) else None
    if kwargs is None:
        return agent_name, {}
    bad = not isinstance(kwargs, Mapping) or any(
        v is not None and not isinstance(v, Mapping) for v in kwargs.values()
    )
    if bad:
        raise DatasetError(
            f"{location}: 'extra_info.tools_kwargs' must map each tool name to a mapping "
            "(verl's {tool: {create_kwargs: ...}})"
        )
    return agent_name, {str(k): dict(v) for k, v in kwargs.items() if v is not None}


def _messages(
    row: Mapping[str, object], location: str, prompt_key: str
) -> tuple[tuple[str, str], ...]:
    """The prompt as ``(role, content)`` pairs ending with a user message."""
    if prompt_key not in row:
        raise DatasetError(
            f"{location}: row has no {prompt_key!r} field (data.prompt_key; "
            f"the row has {', '.join(sorted(row)) or 'no fields'})"
        )
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        messages: tuple[tuple[str, str], ...] = (("user", prompt),)
    elif isinstance(prompt, list) and prompt:
        messages = tuple(
            _message(m, f"{location}: {prompt_key}[{i}]") for i, m in enumerate(prompt)
        )
    else:
        raise DatasetError(
            f"{location}: {prompt_key!r} must be a string or a non-empty list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    if messages[-1][0] != "user" or not messages[-1][1].strip():
        raise DatasetError(f"{location}: {prompt_key!r} must end with a non-empty user message")
    return messages


def _message(message: object, where: str) -> tuple[str, str]:
    if not isinstance(message, dict) or not {"role", "content"} <= set(message):
        raise DatasetError(f"{where} is not a {{'role': ..., 'content': ...}} message")
    role, content = message["role"], message["content"]
    if role not in CHAT_ROLES or not isinstance(content, str):
        raise DatasetError(
            f"{where}: role must be one of {', '.join(CHAT_ROLES)} and content a string"
        )
    return role, content


def _answer(
    row: Mapping[str, object], location: str, answer_key: str | None, reward: Reward
) -> str:
    """The ground truth: a normalised number for a reward that compares numbers, else the text
    as the row has it (a GSM8K-style ``"... #### 72"`` answer reduced to what follows ``####``)."""
    if answer_key is None:
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise DatasetError(
                f"{location}: row has no reward_model.ground_truth (verl's schema); for flat "
                "rows name the answer column with data.answer_key"
            )
        value, field = reward_model["ground_truth"], "reward_model.ground_truth"
    elif answer_key not in row:
        raise DatasetError(f"{location}: row has no {answer_key!r} field (data.answer_key)")
    else:
        value, field = row[answer_key], answer_key
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetError(f"{location}: {field} must be a string or a number")
    text = str(value)
    if not reward.numeric_answers:
        final = text.rsplit(FINAL_ANSWER_MARKER, 1)[1] if FINAL_ANSWER_MARKER in text else text
        if not final.strip():
            raise DatasetError(f"{location}: {field} is empty")
        return final.strip()
    number = parse_final_answer(text) if FINAL_ANSWER_MARKER in text else normalize_number(text)
    if number is None:
        raise DatasetError(
            f"{location}: {field}={text[:60]!r} is not a number, and data.reward ({reward.name}) "
            "compares numbers; use data.reward=math or exact_match, or package.module:function"
        )
    return number

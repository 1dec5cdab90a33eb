"""Loader for GSM8K-style JSONL prompt datasets.

Each non-blank line is a JSON object ``{"question": "...", "answer": "... #### 72"}``; the
final answer is the number after the last ``####``, as in the GSM8K release. Every problem
is reported as ``file:line`` so a bad row can be found and fixed directly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megarl.data.errors import DatasetError
from megarl.data.numbers import normalize_number
from megarl.data.problems import Problem

FINAL_ANSWER_MARKER = "####"


def load_jsonl_problems(path: str | os.PathLike[str], instruction: str = "") -> list[Problem]:
    """Load every row of a GSM8K-style JSONL file as a :class:`Problem`.

    Args:
        path: The ``.jsonl`` file. Blank lines are skipped.
        instruction: Appended to each question after a space (e.g. ``"Put the final answer
            after ####."``), so the model is told the answer format the reward expects.

    Raises:
        DatasetError: The file cannot be read, holds no rows, or any row is malformed; the
            message names the file and the 1-based line of the first bad row. Failing on the
            first bad row, rather than skipping it, keeps a silently shrunken dataset from
            going unnoticed.
    """
    location = str(path)
    lines = _read_lines(location)
    problems = [
        _parse_row(line, f"{location}:{line_number}", instruction)
        for line_number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not problems:
        raise DatasetError(f"{location}: dataset has no rows")
    return problems


def parse_final_answer(answer_text: str) -> str | None:
    """Return the normalised number after the last ``####`` in a GSM8K answer, or None.

    ``"... #### 1,234"`` gives ``"1234"``; ``"#### $5.0"`` gives ``"5"``.
    """
    if FINAL_ANSWER_MARKER not in answer_text:
        return None
    final = answer_text.rsplit(FINAL_ANSWER_MARKER, 1)[1].strip()
    return normalize_number(final)


def _read_lines(location: str) -> list[str]:
    """Read the file as UTF-8 lines, turning I/O and decoding failures into DatasetError.

    Splits on newlines only (not ``str.splitlines``), because JSON strings may legally hold
    raw U+2028/U+0085 characters, which must not split a row or shift the line numbers.
    """
    try:
        return Path(location).read_text(encoding="utf-8-sig").split("\n")
    except FileNotFoundError:
        raise DatasetError(f"{location}: dataset file does not exist") from None
    except OSError as exc:
        raise DatasetError(f"{location}: cannot read dataset file ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{location}: dataset file is not valid UTF-8 ({exc.reason})") from exc


def _parse_row(line: str, source: str, instruction: str) -> Problem:
    """Turn one JSONL line into a Problem; ``source`` is the ``file:line`` used in errors."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{source}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{source}: row is a JSON {type(row).__name__}, expected an object")
    question = _required_string(row, "question", source)
    answer_text = _required_string(row, "answer", source)
    if not question.strip():
        raise DatasetError(f"{source}: row has an empty 'question'")
    if FINAL_ANSWER_MARKER not in answer_text:
        raise DatasetError(f"{source}: 'answer' has no '#### <number>' final answer")
    answer = parse_final_answer(answer_text)
    if answer is None:
        final = answer_text.rsplit(FINAL_ANSWER_MARKER, 1)[1].strip()
        raise DatasetError(f"{source}: final answer after '####' is not a number: {final!r}")
    return Problem(prompt=_with_instruction(question, instruction), answer=answer, source=source)


def _required_string(row: dict[str, object], field: str, source: str) -> str:
    """Return ``row[field]``, raising DatasetError if it is missing or not a string."""
    if field not in row:
        raise DatasetError(f"{source}: row has no '{field}' field")
    value = row[field]
    if not isinstance(value, str):
        kind = type(value).__name__
        raise DatasetError(f"{source}: '{field}' must be a string, got {kind}")
    return value


def _with_instruction(question: str, instruction: str) -> str:
    """Append the instruction after a single space, or return the question unchanged."""
    question = question.strip()
    if not instruction.strip():
        return question
    return f"{question} {instruction.strip()}"

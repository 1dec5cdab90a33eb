"""Rule-based rewards: does a model response contain the ground-truth number?

Rewards are 1.0 or 0.0. GRPO normalises rewards within a group, so a binary
correctness signal is enough, and it cannot be gamed the way a partial-credit heuristic
could.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

from megarl.data.numbers import normalize_number, numbers_equal

RewardFn = Callable[[str, str], float]

# A number as a model writes it: optional sign, thousands separators ("1,234,567") only when
# every group has exactly three digits, optional decimals. A minus sign counts only when it
# does not directly follow a word or number, so "12-7" reads as 12 and 7, not 12 and -7.
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w.)])[-\u2212])?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?:\.\d+)?"
)
_FINAL_ANSWER_MARKER = "####"


def extract_last_number(text: str) -> str | None:
    """Return the last number in ``text``, normalised (``"1,234"`` -> ``"1234"``), or None.

    The last number is used because models tend to restate or compute intermediate values
    before the final answer ("12 + 7 = 19"). A sentence-ending period is not a decimal
    point ("The answer is 19." -> ``"19"``).
    """
    matches = _NUMBER_IN_TEXT.findall(text)
    if not matches:
        return None
    return normalize_number(matches[-1])


def extract_first_number(text: str) -> str | None:
    """Return the first number in ``text``, normalised, or None."""
    match = _NUMBER_IN_TEXT.search(text)
    return normalize_number(match.group()) if match else None


def exact_match_last_number(response: str, answer: str) -> float:
    """1.0 if the last number in ``response`` equals ``answer`` numerically, else 0.0.

    Used for the arithmetic task, whose prompts ask for just the number.

    Raises:
        ValueError: ``answer`` is not a number; that is a bug in the data, not a wrong
            response, so it must not be silently scored as 0.0.
    """
    _require_numeric_answer(answer)
    predicted = extract_last_number(response)
    return _score(predicted, answer)


def gsm8k_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals ``answer`` numerically, else 0.0.

    The final answer is the number after the last ``####`` in the response when there is
    one (the GSM8K convention the prompt may ask for), else the last number in the response.

    Raises:
        ValueError: ``answer`` is not a number.
    """
    _require_numeric_answer(answer)
    return _score(extract_gsm8k_answer(response), answer)


def extract_gsm8k_answer(response: str) -> str | None:
    """Return the number after the last ``####`` if there is one, else the last number."""
    if _FINAL_ANSWER_MARKER in response:
        after_marker = response.rsplit(_FINAL_ANSWER_MARKER, 1)[1]
        marked = extract_first_number(after_marker)
        if marked is not None:
            return marked
    return extract_last_number(response)


REWARD_FNS: dict[str, RewardFn] = {
    "exact_last_number": exact_match_last_number,
    "gsm8k": gsm8k_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    """Look up a reward function by its config name, or import ``package.module:function``.

    The import form lets users plug in their own ``(response, answer) -> float`` without
    touching megarl.
    """
    if ":" in name:
        return _import_reward_fn(name)
    try:
        return REWARD_FNS[name]
    except KeyError:
        valid = ", ".join(sorted(REWARD_FNS))
        raise ValueError(
            f"data.reward={name!r}: unknown reward function; valid names: {valid}, "
            "or package.module:function"
        ) from None


def _import_reward_fn(path: str) -> RewardFn:
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"data.reward={path!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise ValueError(f"data.reward={path!r} is not callable")
    return cast(RewardFn, fn)  # the user's function; only its being callable is checked


def _score(predicted: str | None, answer: str) -> float:
    """Binary reward for an extracted prediction (None means no number was found)."""
    if predicted is None:
        return 0.0
    return 1.0 if numbers_equal(predicted, answer) else 0.0


def _require_numeric_answer(answer: str) -> None:
    """Reject a ground truth that is not a number, naming it in the message."""
    if normalize_number(answer) is None:
        raise ValueError(f"ground-truth answer must be a number, got {answer!r}")

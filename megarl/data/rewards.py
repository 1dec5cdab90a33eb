"""Rule-based rewards: does a model response contain the ground-truth number?

Rewards are 1.0 or 0.0. GRPO normalises rewards within a group, so a binary
correctness signal is enough, and it cannot be gamed the way a partial-credit heuristic
could.

A user's own function (``data.reward=package.module:function``) is called through
:func:`score_samples`, which checks every value it returns: one NaN, ``None`` or string would
otherwise turn into a NaN advantage for the whole group and a NaN loss several steps later, far
from its cause. A bad value or an exception is a :class:`RewardFunctionError` naming the
function, the sample and what came back (``data.reward_error=raise``, the default), or that
sample scores 0.0 and is counted (``data.reward_error=zero``).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from megarl.data.numbers import normalize_number, numbers_equal
from megarl.errors import BadInputError

RewardFn = Callable[[str, str], float]

REWARD_ERROR_POLICIES: tuple[str, ...] = ("raise", "zero")
"""``data.reward_error``: what a reward function that raises or returns a non-number does:
``raise`` (stop the run with one line, exit 2) | ``zero`` (score that sample 0.0, count it)."""

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
    _require_two_arguments(path, fn)
    return cast(RewardFn, fn)  # the user's function; its values are checked per call


def _require_two_arguments(path: str, fn: Callable[..., object]) -> None:
    """Refuse at start-up a function that cannot be called as ``fn(response, answer)``, rather
    than at the first reward, minutes into the run."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension without one: checked per call
        return
    try:
        signature.bind("response", "answer")
    except TypeError as exc:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"data.reward={path!r}: must be callable as fn(response, answer), but {name}"
            f"{signature} cannot ({exc})"
        ) from None


def _score(predicted: str | None, answer: str) -> float:
    """Binary reward for an extracted prediction (None means no number was found)."""
    if predicted is None:
        return 0.0
    return 1.0 if numbers_equal(predicted, answer) else 0.0


def _require_numeric_answer(answer: str) -> None:
    """Reject a ground truth that is not a number, naming it in the message."""
    if normalize_number(answer) is None:
        raise ValueError(f"ground-truth answer must be a number, got {answer!r}")


# --- calling a reward function, and checking what it returns --------------------------------


class RewardFunctionError(BadInputError):
    """A reward function raised, or returned something other than one finite number."""


@dataclass(frozen=True)
class ScoredSamples:
    """One step's rewards, and the samples whose function failed (scored 0.0 under ``zero``)."""

    rewards: tuple[float, ...]
    failures: int = 0
    """Samples whose reward function raised or returned a non-number."""
    first_failure: str | None = None
    """The one-line report of the first of them, for a warning."""


def reward_value(value: object) -> float:
    """``value`` as a finite float, or :class:`ValueError` saying what it was instead.

    Accepted: a real number (``bool`` counts, as 1.0 or 0.0; NumPy scalars too), a 0-d
    array or tensor, and verl's ``{"score": x, ...}`` dict.
    """
    if isinstance(value, Mapping) and "score" in value:
        value = cast(Mapping[str, object], value)["score"]
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = cast("Any", value).item()
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
    raise ValueError(_describe(value))


def _describe(value: object) -> str:
    """What a reward function returned, in a few words (for the one-line error)."""
    if value is None:
        return "None"
    if isinstance(value, numbers.Real):
        return repr(float(value))  # nan, inf, -inf
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"a string {text!r}"
    if isinstance(value, Sequence | Mapping):
        count = len(value)
        return f"a {type(value).__name__} of {count} value{'s' if count != 1 else ''}"
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    return f"a {type(value).__name__}"


def score_samples(
    fn: RewardFn,
    name: str,
    responses: Sequence[str],
    answers: Sequence[str],
    policy: str = "raise",
    step: int | None = None,
) -> ScoredSamples:
    """Call ``fn(response, answer)`` per sample and check each value (see :func:`reward_value`).

    ``name`` is the ``data.reward`` value, so the message names what the user configured.
    Under ``policy="raise"`` the first failure raises :class:`RewardFunctionError`; under
    ``"zero"`` it scores 0.0 and is counted. Only ``Exception`` is caught: Ctrl-C still stops
    the run.
    """
    if policy not in REWARD_ERROR_POLICIES:
        raise ValueError(f"reward error policy {policy!r}: must be one of raise, zero")
    rewards: list[float] = []
    failures: list[str] = []
    where = f" (step {step})" if step is not None else ""
    for index, (response, answer) in enumerate(zip(responses, answers, strict=True)):
        try:
            returned = fn(response, answer)
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure is reported
            detail = " ".join(str(exc).split())[:200]
            problem = f"raised {type(exc).__name__}{': ' + detail if detail else ''}"
        else:
            try:
                rewards.append(reward_value(returned))
                continue
            except ValueError as exc:
                problem = f"returned {exc} (expected one finite number)"
        message = f"data.reward={name}: sample {index}{where} {problem}"
        if policy == "raise":
            raise RewardFunctionError(
                f"{message}; fix the function, or set data.reward_error=zero to score such "
                "samples 0"
            )
        failures.append(message)
        rewards.append(0.0)
    return ScoredSamples(tuple(rewards), len(failures), failures[0] if failures else None)

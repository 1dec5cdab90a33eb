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

With ``data.reward=auto`` a dataset's rows are scored by their ``data_source`` column, as verl's
``default_compute_score`` does: GSM8K rows by their final number, MATH rows by their last
``\\boxed{}`` answer checked for mathematical equivalence with ``math-verify``. A source with no
built-in reward is refused when the dataset loads, naming the row, instead of scoring every
sample 0 for the whole run.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from megarl.data.numbers import normalize_number, numbers_equal
from megarl.errors import BadInputError, RunAborted
from megarl.user_code import describe_user_exception, user_call

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


def extract_last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    balanced, or None: MATH solutions and the models trained on them put the answer there."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for index in range(opening, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1 : index].strip()
    return None  # unbalanced: the response was cut off inside the box


def math_reward(response: str, answer: str) -> float:
    """1.0 if the last ``\\boxed{}`` of ``response`` is mathematically equal to ``answer``.

    Equal strings (ignoring spaces, ``$`` and ``\\left``/``\\right``) score without parsing;
    otherwise both sides are parsed by ``math-verify`` and compared symbolically, so
    ``\\frac{1}{2}``, ``0.5`` and ``\\dfrac12`` agree. No box scores 0.0: the MATH prompt asks
    for one, and a last-number fallback would reward answers the model never committed to.
    """
    predicted = extract_last_boxed(response)
    if predicted is None:
        return 0.0
    if _latex_key(predicted) == _latex_key(answer):
        return 1.0
    return 1.0 if _math_equivalent(predicted, answer) else 0.0


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer is ``answer`` as a string (spaces, ``$`` and a final
    period aside). The final answer is the last ``\\boxed{}``, else what follows the last
    ``####``, else the whole response: for answers that are words or labels, not numbers."""
    return 1.0 if _latex_key(_final(response)) == _latex_key(answer) else 0.0


def _final(response: str) -> str:
    """The last ``\\boxed{}``, else what follows the last ``####``, else the whole response."""
    boxed = extract_last_boxed(response)
    if boxed is not None:
        return boxed
    if _FINAL_ANSWER_MARKER in response:
        return response.rsplit(_FINAL_ANSWER_MARKER, 1)[1]
    return response


def _latex_key(text: str) -> str:
    """``text`` without what never changes an answer's meaning: spaces, ``$``,
    ``\\left``/``\\right``, ``\\!`` and a final period (for a fast exact comparison)."""
    for noise in ("\\left", "\\right", "\\!", "$"):
        text = text.replace(noise, "")
    return "".join(text.split()).rstrip(".")


def _latex_key_of(text: str | None) -> str | None:
    return None if text is None else _latex_key(text)


def _math_equivalent(predicted: str, answer: str) -> bool:
    """``math-verify``'s symbolic comparison of two LaTeX answers. Its timeouts use
    ``signal.alarm``, which works only on the main thread; elsewhere they are off."""
    import threading

    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse("\\boxed{" + answer + "}", parsing_timeout=limit)  # type: ignore[arg-type]
    guess = parse("\\boxed{" + predicted + "}", parsing_timeout=limit)  # type: ignore[arg-type]
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, timeout_seconds=limit))


# --- choosing the reward: by name, by import path, or by each row's data_source -------------


@dataclass(frozen=True)
class Reward:
    """A reward function and what it needs of the ground truth."""

    name: str
    """Its ``data.reward`` name (``gsm8k``), or the ``package.module:function`` it came from."""
    fn: RewardFn
    numeric_answers: bool = False
    """The ground truth must be a number: rows are checked, and their answers normalised,
    when the dataset loads (a user's function gets the text as the dataset has it)."""
    final_answer: Callable[[str], str | None] | None = None
    """What a response answered, in a form where equal answers are equal strings (for
    majority voting, ``maj@k``); None = the reward cannot say (a user's function)."""


BUILTIN_REWARDS: dict[str, Reward] = {
    reward.name: reward
    for reward in (
        Reward("exact_last_number", exact_match_last_number, True, extract_last_number),
        Reward("gsm8k", gsm8k_reward, True, extract_gsm8k_answer),
        Reward("math", math_reward, False, lambda text: _latex_key_of(extract_last_boxed(text))),
        Reward("exact_match", exact_match_reward, False, lambda text: _latex_key(_final(text))),
    )
}
"""The rewards ``data.reward`` names; ``auto`` picks among them by ``data_source``."""

DATA_SOURCE_REWARDS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "hendrycks/competition_math": "math",
    "math": "math",
}
"""``data.reward=auto``: the built-in reward of each ``data_source`` (verl's names for the
datasets its preprocessing scripts write). Rows without a ``data_source`` score by their final
number (``gsm8k``), as flat question/answer files always have."""


@dataclass(frozen=True)
class RewardChoice:
    """``data.reward`` resolved: one reward for every sample, or (``auto`` on a dataset) the
    reward of each row's ``data_source``."""

    configured: str
    """``data.reward`` as set, for messages."""
    fixed: Reward | None
    """The reward of every sample; None = by ``data_source``."""

    def for_source(self, data_source: str) -> Reward:
        """The reward of a row from ``data_source``.

        Raises:
            ValueError: ``data.reward=auto`` and no built-in reward knows ``data_source``.
        """
        if self.fixed is not None:
            return self.fixed
        if not data_source:
            return BUILTIN_REWARDS["gsm8k"]
        name = DATA_SOURCE_REWARDS.get(data_source)
        if name is None:
            raise ValueError(
                f"data_source {data_source!r} has no built-in reward (known: "
                f"{', '.join(sorted(DATA_SOURCE_REWARDS))}); set data.reward to one of "
                f"{', '.join(BUILTIN_REWARDS)} or package.module:function"
            )
        return BUILTIN_REWARDS[name]

    def final_answer(self, response: str, data_source: str) -> str | None:
        """What ``response`` answered, by the reward of its ``data_source`` (for ``maj@k``)."""
        extract = self.for_source(data_source).final_answer
        return None if extract is None else extract(response)

    def label(self, reward: Reward) -> str:
        """How a message names ``reward``: ``data.reward=auto (math)`` or ``data.reward=gsm8k``."""
        if self.configured == reward.name:
            return f"data.reward={reward.name}"
        return f"data.reward={self.configured} ({reward.name})"


def choose_reward(configured: str, task: str) -> RewardChoice:
    """The :class:`RewardChoice` of ``data.reward=configured`` for ``data.task=task``:
    ``auto`` is the final number for the built-in arithmetic task and by ``data_source`` for
    datasets.

    Raises:
        ValueError: an unknown name, or a ``package.module:function`` that cannot be used.
    """
    if configured == "auto":
        fixed = BUILTIN_REWARDS["exact_last_number"] if task == "arithmetic" else None
        return RewardChoice(configured, fixed)
    if ":" in configured:
        return RewardChoice(configured, Reward(configured, _import_reward_fn(configured)))
    if configured not in BUILTIN_REWARDS:
        valid = ", ".join(["auto", *BUILTIN_REWARDS])
        raise ValueError(
            f"data.reward={configured!r}: unknown reward function; valid names: {valid}, "
            "or package.module:function"
        )
    return RewardChoice(configured, BUILTIN_REWARDS[configured])


@dataclass(frozen=True)
class RewardComponent:
    """One of several reward functions of ``data.reward`` (its list form): each scores every
    sample; the estimators read the weighted sum, GDPO each score apart."""

    name: str
    """How metrics (``reward/<name>/mean``) and messages name it; default its ``fn``."""
    fn: str
    """What ``data.reward`` takes alone: auto, a built-in name, or package.module:function."""
    weight: float = 1.0
    """Its weight in the sum (GDPO: in the sum of the normalised scores)."""


REWARD_COMPONENT_KEYS: tuple[str, ...] = ("name", "fn", "weight")


def parse_reward_components(value: object) -> tuple[RewardComponent, ...]:
    """``data.reward`` in its list form, each entry a mapping ``{name, fn, weight}`` (``fn``
    required; ``name`` defaults to ``fn``, ``weight`` to 1), checked; TRL's ``reward_funcs`` with
    ``reward_weights``, NeMo-RL's ``reward/<name>`` components, as one list.

    Raises:
        ValueError: one line naming the entry (``data.reward[1].weight``) and what is wrong.
    """
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"data.reward={value!r}: expected a name, package.module:function, or a non-empty "
            "list of {name, fn, weight}"
        )
    components: list[RewardComponent] = []
    for index, entry in enumerate(value):
        key = f"data.reward[{index}]"
        if isinstance(entry, RewardComponent):
            entry = {"name": entry.name, "fn": entry.fn, "weight": entry.weight}
        if not isinstance(entry, Mapping):
            raise ValueError(f"{key}={entry!r}: expected a mapping {{name, fn, weight}}")
        unknown = sorted(set(entry) - set(REWARD_COMPONENT_KEYS))
        if unknown:
            raise ValueError(
                f"{key}: unknown key {unknown[0]!r} (valid: {', '.join(REWARD_COMPONENT_KEYS)})"
            )
        fn = entry.get("fn")
        if not isinstance(fn, str) or not fn:
            raise ValueError(f"{key}.fn={fn!r}: a reward function is required (as data.reward)")
        if ":" not in fn and fn not in ("auto", *BUILTIN_REWARDS):
            valid = ", ".join(["auto", *BUILTIN_REWARDS])
            raise ValueError(
                f"{key}.fn={fn!r}: unknown reward function; valid names: {valid}, or "
                "package.module:function"
            )
        name = entry.get("name", fn)
        if not isinstance(name, str) or not re.fullmatch(r"[\w.:-]+", name):
            raise ValueError(
                f"{key}.name={name!r}: a non-empty name of letters, digits, _ . : - (it names "
                "the metric reward/<name>/mean)"
            )
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise ValueError(f"{key}.weight={weight!r}: expected a number")
        if not math.isfinite(float(weight)):
            raise ValueError(f"{key}.weight={weight!r}: must be a finite number")
        if any(c.name == name for c in components):
            raise ValueError(f"{key}.name={name!r}: two reward functions have that name")
        components.append(RewardComponent(name, fn, float(weight)))
    return tuple(components)


@dataclass(frozen=True)
class WeightedReward:
    """A :class:`RewardComponent` resolved: its :class:`RewardChoice` and its weight."""

    name: str
    choice: RewardChoice
    weight: float


def choose_rewards(components: Sequence[RewardComponent], task: str) -> tuple[WeightedReward, ...]:
    """Each component's :class:`RewardChoice` (:func:`choose_reward`), with its name and weight.

    Raises:
        ValueError: a function that cannot be used, named by its entry (``data.reward[1].fn``).
    """
    chosen = []
    for index, c in enumerate(components):
        try:
            chosen.append(WeightedReward(c.name, choose_reward(c.fn, task), c.weight))
        except ValueError as exc:
            message = str(exc).replace("data.reward=", f"data.reward[{index}].fn=", 1)
            raise ValueError(message) from None
    return tuple(chosen)


def get_reward_fn(name: str) -> RewardFn:
    """The function ``data.reward=name`` names (a built-in or ``package.module:function``)."""
    choice = choose_reward(name, task="files")
    if choice.fixed is None:
        raise ValueError("data.reward=auto chooses a function per data_source; name one")
    return choice.fixed.fn


def _import_reward_fn(path: str) -> RewardFn:
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        with user_call(f"data.reward={path!r}: import"):
            fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"data.reward={path!r}: cannot import it ({exc})") from None
    except RunAborted:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raised on import
        raise ValueError(
            f"data.reward={path!r}: importing {module_name!r} failed: "
            f"{describe_user_exception(exc)}"
        ) from None
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


class RewardTimeout(Exception):
    """One call of a reward function did not return within ``data.reward_timeout_s``."""


def call_bounded(fn: RewardFn, response: str, answer: str, timeout_s: float | None) -> object:
    """``fn(response, answer)``, in a thread of its own when ``timeout_s`` is set, so that a call
    that never returns (a stuck network request) is a :class:`RewardTimeout` after that long
    instead of a hang. Python cannot stop a thread: a timed-out call is left running in a
    daemon thread, which ends with the process. The caller's thread waits interruptibly, so a
    stop request (SIGTERM/SIGINT) still stops the run at once."""
    if timeout_s is None:
        return fn(response, answer)
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            outcome["value"] = fn(response, answer)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = exc
        finally:
            done.set()

    context = contextvars.copy_context()  # the thread runs inside the caller's user call
    threading.Thread(target=context.run, args=(call,), name="megarl-reward", daemon=True).start()
    if not done.wait(timeout_s):
        raise RewardTimeout(f"did not return within data.reward_timeout_s={timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def score_samples(
    choice: RewardChoice,
    responses: Sequence[str],
    answers: Sequence[str],
    data_sources: Sequence[str] | None = None,
    policy: str = "raise",
    step: int | None = None,
    timeout_s: float | None = None,
    first_index: int = 0,
) -> ScoredSamples:
    """Score each sample with its reward (``choice``, by the sample's ``data_source``) and
    check each value (see :func:`reward_value`). A user's function (not a built-in) that
    takes longer than ``timeout_s`` for one sample has failed on it (:func:`call_bounded`).
    ``first_index``: the step's number of the first sample (a part of a step scored alone, as
    the asynchronous rollout scores each group: messages number samples as the step does).

    Messages name ``data.reward`` as the user set it, and what the function raised with the
    ``file:line`` it came from. Every call goes through :func:`megarl.user_code.user_call`: a
    ``SystemExit`` (of any code) or a ``KeyboardInterrupt`` the function raises is its failure
    like any exception, never the run's exit. Under ``policy="raise"`` the first
    failure raises :class:`RewardFunctionError`; under ``"zero"`` it scores 0.0 and is
    counted. A stop request or the launcher's watch (:class:`~megarl.errors.RunAborted`, raised
    wherever the main thread is, inside the function too) is never taken for the function's
    failure: it goes on ending the run.
    """
    if policy not in REWARD_ERROR_POLICIES:
        raise ValueError(f"reward error policy {policy!r}: must be one of raise, zero")
    sources = [""] * len(responses) if data_sources is None else data_sources
    where = f" (step {step})" if step is not None else ""
    users = choice.fixed is not None and choice.fixed.name not in BUILTIN_REWARDS
    scoring = f"data.reward={choice.configured}: scoring {len(responses)} samples{where}"
    with user_call(scoring) if users else contextlib.nullcontext():
        return _score_each(
            choice, responses, answers, sources, policy, where, timeout_s, first_index
        )


def _score_each(
    choice: RewardChoice,
    responses: Sequence[str],
    answers: Sequence[str],
    sources: Sequence[str],
    policy: str,
    where: str,
    timeout_s: float | None,
    first_index: int,
) -> ScoredSamples:
    """:func:`score_samples`' loop over the samples, each call its own user call."""
    rewards: list[float] = []
    failures: list[str] = []
    for index, (response, answer, source) in enumerate(
        zip(responses, answers, sources, strict=True), start=first_index
    ):
        reward = choice.for_source(source)
        users = reward.name not in BUILTIN_REWARDS
        limit = timeout_s if users else None
        call = f"{choice.label(reward)}: sample {index}{where}"
        try:
            with user_call(call, publish=False) if users else contextlib.nullcontext():
                returned = call_bounded(reward.fn, response, answer, limit)
        except RunAborted:
            raise
        except RewardTimeout as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure is reported
            problem = f"raised {describe_user_exception(exc)}"
        else:
            try:
                rewards.append(reward_value(returned))
                continue
            except ValueError as exc:
                problem = f"returned {exc} (expected one finite number)"
        message = f"{choice.label(reward)}: sample {index}{where} {problem}"
        if policy == "raise":
            raise RewardFunctionError(
                f"{message}; fix the function, or set data.reward_error=zero to score such "
                "samples 0"
            )
        failures.append(message)
        rewards.append(0.0)
    return ScoredSamples(tuple(rewards), len(failures), failures[0] if failures else None)

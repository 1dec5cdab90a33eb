"""Reward extraction and scoring, including the edge cases models actually produce."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megarl.data.numbers import normalize_number, numbers_equal
from megarl.data.rewards import (
    BUILTIN_REWARDS,
    Reward,
    RewardChoice,
    RewardFunctionError,
    ScoredSamples,
    choose_reward,
    exact_match_last_number,
    extract_gsm8k_answer,
    extract_last_number,
    get_reward_fn,
    gsm8k_reward,
    math_reward,
    reward_value,
    score_samples,
)
from megarl.distributed.launcher import stop_on_signals
from megarl.errors import RunStopped


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 19.", "19"),
        ("12 + 7 = 20", "20"),
        ("-3", "-3"),
        ("The result is -3.", "-3"),
        ("1,234", "1234"),
        ("It costs $1,234,567.89 in total.", "1234567.89"),
        ("3.5", "3.5"),
        ("42.0", "42"),
        ("12-7", "7"),
        ("(-4)", "-4"),
        ("1, 2, 3", "3"),
        ("1,2345", "2345"),
        ("\u22125", "-5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("The answer is 19.", "19", 1.0),
        ("12 + 7 = 20", "19", 0.0),
        ("12 + 7 = 20", "20", 1.0),
        ("-3", "-3", 1.0),
        ("-3", "3", 0.0),
        ("1,234", "1234", 1.0),
        ("42.0", "42", 1.0),
        ("42", "42.0", 1.0),
        ("I don't know", "42", 0.0),
        ("19 apples", "190", 0.0),
    ],
)
def test_exact_match_last_number(response: str, answer: str, reward: float) -> None:
    assert exact_match_last_number(response, answer) == reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 7\nI also checked 9 other things.", "7", 1.0),
        ("#### 9 is wrong, see 7", "7", 0.0),
        ("She has 20 - 8 = 12 dollars left.", "12", 1.0),
        ("#### $30,000", "30000", 1.0),
        ("Total is 5. ####", "5", 1.0),
        ("no number at all ####", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_gsm8k_reward(response: str, answer: str, reward: float) -> None:
    assert gsm8k_reward(response, answer) == reward


def test_gsm8k_prefers_the_last_marker() -> None:
    assert extract_gsm8k_answer("#### 1\nActually: #### 2") == "2"


@pytest.mark.parametrize("reward_fn", [exact_match_last_number, gsm8k_reward])
def test_non_numeric_ground_truth_is_a_loud_error(reward_fn) -> None:
    with pytest.raises(ValueError, match="'seven'"):
        reward_fn("7", "seven")


def test_registry_and_lookup() -> None:
    assert set(BUILTIN_REWARDS) == {"exact_last_number", "gsm8k", "math", "exact_match"}
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("exact_last_number") is exact_match_last_number


def test_unknown_reward_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="auto, exact_last_number, gsm8k, math") as info:
        get_reward_fn("f1")
    assert "'f1'" in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", "1234"),
        ("$ 5", "5"),
        ("5.0", "5"),
        ("5.00", "5"),
        ("-0", "0"),
        ("2.50", "2.50"),
        ("7.", "7"),
        ("abc", None),
        ("1e5", None),
        ("", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


def test_numbers_equal_compares_values_not_spellings() -> None:
    assert numbers_equal("2.5", "2.50")
    assert numbers_equal("12345678901234567890", "12,345,678,901,234,567,890")
    assert not numbers_equal("12345678901234567890", "12345678901234567891")
    assert not numbers_equal("x", "x")


# --- a user's reward function: every returned value checked, every failure one line --------


class _Scalar:
    """A 0-d array or tensor, as NumPy and torch return from a reduction."""

    ndim = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (1, 1.0),
        (0.25, 0.25),
        (True, 1.0),
        (False, 0.0),
        (-2.5, -2.5),
        ({"score": 0.5, "acc": True}, 0.5),  # verl's dict convention
        (_Scalar(0.75), 0.75),
    ],
)
def test_reward_value_accepts_one_finite_number(returned, expected) -> None:
    assert reward_value(returned) == expected


@pytest.mark.parametrize(
    ("returned", "described"),
    [
        (None, "None"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (float("-inf"), "-inf"),
        ("1.0", "a string '1.0'"),
        ("x" * 100, "a string 'xxxxxxxx"),
        ([1.0, 0.0, 1.0], "a list of 3 values"),
        ((1.0,), "a tuple of 1 value"),
        ({"acc": 1.0}, "a dict of 1 value"),
        (_Scalar(float("nan")), "nan"),
        (object(), "a object"),
    ],
)
def test_reward_value_refuses_everything_else_saying_what_it_was(returned, described) -> None:
    with pytest.raises(ValueError) as info:
        reward_value(returned)
    assert str(info.value).startswith(described)


def _returns(value):
    return lambda response, answer: value


def _raises(response: str, answer: str) -> float:
    if response == "bad":
        raise ZeroDivisionError("division by zero\nsecond line")
    return 1.0


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (_returns(None), "sample 0 (step 3) returned None (expected one finite number)"),
        (_returns(float("nan")), "returned nan"),
        (_returns("yes"), "returned a string 'yes'"),
        (_returns([1.0, 1.0]), "returned a list of 2 values"),
        (_raises, "sample 1 (step 3) raised ZeroDivisionError: division by zero second line"),
    ],
)
def test_a_failing_reward_function_is_one_line_naming_function_sample_and_value(fn, needle):
    with pytest.raises(RewardFunctionError) as info:
        score_samples(_fixed(fn, "my_rewards:score"), ["ok", "bad"], ["1", "1"], None, "raise", 3)
    message = str(info.value)
    assert message.startswith("data.reward=my_rewards:score: sample ")
    assert needle in message and "\n" not in message
    assert "data.reward_error=zero" in message
    assert info.value.exit_code == 2


def test_reward_error_zero_scores_failures_zero_and_counts_them() -> None:
    scored = score_samples(_fixed(_raises), ["ok", "bad", "bad", "ok"], ["1"] * 4, None, "zero", 1)
    assert scored.rewards == (1.0, 0.0, 0.0, 1.0)
    assert scored.failures == 2
    assert scored.first_failure is not None and "sample 1 (step 1)" in scored.first_failure


def test_good_rewards_pass_through_unchanged() -> None:
    scored = score_samples(choose_reward("gsm8k", "files"), ["#### 7", "6"], ["7", "7"])
    assert scored == ScoredSamples((1.0, 0.0), 0, None)


def test_ctrl_c_in_a_reward_function_is_not_swallowed() -> None:
    def interrupted(response: str, answer: str) -> float:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_samples(_fixed(interrupted), ["a"], ["1"], None, "zero")


def _exits(response: str, answer: str) -> float:
    if response == "bad":
        raise SystemExit(False)  # what unittest.main() raises when the checks pass
    return 1.0


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_reward_function_that_exits_fails_its_sample_never_the_run(timeout_s) -> None:
    """``SystemExit`` (any code) is the function's failure under both policies, in the caller's
    thread and in the timed one, named with where it was raised."""
    with pytest.raises(RewardFunctionError) as info:
        score_samples(_fixed(_exits), ["ok", "bad"], ["1", "1"], None, "raise", 3, timeout_s)
    message = str(info.value)
    assert "sample 1 (step 3) raised SystemExit(False) (at tests/unit/test_data_rewards.py:" in (
        message
    )
    scored = score_samples(_fixed(_exits), ["bad", "ok"], ["1", "1"], None, "zero", 3, timeout_s)
    assert scored.rewards == (0.0, 1.0) and scored.failures == 1


@pytest.mark.parametrize("policy", ["raise", "zero"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_request_during_a_reward_function_stops_the_run(policy, sig) -> None:
    """SIGTERM/SIGINT arrive while the user's function runs (a real signal, the launcher's own
    handler): the run stops (exit 143/130), neither reported as the function's error nor, under
    ``data.reward_error=zero``, scored 0 and trained on."""
    calls: list[str] = []

    def slow(response: str, answer: str) -> float:
        calls.append(response)
        os.kill(os.getpid(), sig)  # the handler raises at the next bytecode, in here
        signal.sigtimedwait([], 0)
        return 1.0

    with pytest.raises(RunStopped) as stopped, stop_on_signals():
        score_samples(_fixed(slow), ["a", "b"], ["1", "1"], None, policy)
    assert calls == ["a"]  # the second sample was never scored
    assert stopped.value.exit_code == 128 + sig


@pytest.mark.parametrize("policy", ["raise", "zero"])
def test_a_reward_call_that_never_returns_is_a_failure_after_the_timeout(policy) -> None:
    """A stuck call (a network request that never answers) is the function's failure after
    ``data.reward_timeout_s``: one line under ``raise``, scored 0 and counted under ``zero``."""
    release = threading.Event()

    def stuck(response: str, answer: str) -> float:
        if response == "stuck":
            release.wait(30)
        return 1.0

    started = time.perf_counter()
    try:
        if policy == "raise":
            with pytest.raises(RewardFunctionError) as info:
                score_samples(_fixed(stuck), ["ok", "stuck"], ["1", "1"], None, policy, 2, 0.2)
            assert "sample 1 (step 2) did not return within data.reward_timeout_s=0.2 s" in str(
                info.value
            )
        else:
            scored = score_samples(
                _fixed(stuck), ["ok", "stuck", "ok"], ["1"] * 3, None, policy, 2, 0.2
            )
            assert scored.rewards == (1.0, 0.0, 1.0) and scored.failures == 1
    finally:
        release.set()
    assert time.perf_counter() - started < 5


def test_the_timeout_leaves_built_in_rewards_and_fast_functions_as_they_were() -> None:
    gsm8k = score_samples(
        choose_reward("gsm8k", "files"), ["#### 7"], ["7"], None, "raise", 1, 1e-9
    )
    assert gsm8k.rewards == (1.0,)  # a built-in is never put in a thread nor timed
    fast = score_samples(_fixed(lambda r, a: 0.5), ["a"], ["1"], None, "raise", 1, 5.0)
    assert fast.rewards == (0.5,)
    with pytest.raises(RewardFunctionError, match="raised ZeroDivisionError"):
        score_samples(_fixed(_raises), ["ok", "bad"], ["1", "1"], None, "raise", 1, 5.0)


def test_a_reward_function_that_cannot_take_response_and_answer_is_refused_on_import(
    tmp_path, monkeypatch
) -> None:
    (tmp_path / "sig_rewards.py").write_text(
        "def one(response):\n    return 1.0\n\n"
        "def extra(response, answer, *, scale=1.0, **kw):\n    return scale\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        get_reward_fn("sig_rewards:one")
    message = str(info.value)
    assert message.startswith("data.reward='sig_rewards:one': must be callable as fn(response,")
    assert "one(response) cannot (too many positional arguments)" in message
    assert get_reward_fn("sig_rewards:extra")("x", "1") == 1.0


@pytest.mark.parametrize(
    ("body", "raised"),
    [
        ("import os\nKEY = os.environ['MEGARL_NO_SUCH_KEY']\n", "KeyError: 'MEGARL_NO_SUCH_KEY'"),
        ("raise SystemExit(0)\n", "SystemExit(0)"),
        ("1 / 0\n", "ZeroDivisionError: division by zero"),
    ],
)
def test_a_reward_module_whose_import_raises_anything_is_one_bad_input_line(
    tmp_path, monkeypatch, body, raised
) -> None:
    """An API key read at import, an exit, a bug: ``data.reward``'s one line (a ValueError,
    which start-up turns into exit 2), naming what was raised and where."""
    name = f"import_fails_{abs(hash(body))}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        get_reward_fn(f"{name}:score")
    message = str(info.value)
    assert message.startswith(f"data.reward='{name}:score': importing '{name}' failed: {raised}")
    assert f"{name}.py:" in message and "\n" not in message


def _fixed(fn, name: str = "m:f") -> RewardChoice:
    """``data.reward=name`` for a function defined in the test (as an import would give it)."""
    return RewardChoice(name, Reward(name, fn))


# --- MATH answers: the last \boxed{}, compared by math-verify ------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $x = \boxed{\frac{14}{3}}$.", r"\frac{14}{3}"),
        (
            r"\boxed{1} then \boxed{ \left( 3, \frac{\pi}{2} \right) }",
            r"\left( 3, \frac{\pi}{2} \right)",
        ),
        (r"\fbox{42}", "42"),
        (r"no box here, the answer is 5", None),
        (r"cut off \boxed{\frac{1}{2", None),
    ],
)
def test_the_last_box_is_the_answer(text, expected) -> None:
    from megarl.data.rewards import extract_last_boxed

    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        (r"... = \boxed{\frac{14}{3}}", r"\frac{14}{3}", 1.0),  # same string
        (r"... = \boxed{\dfrac{14}{3}}", r"\frac{14}{3}", 1.0),  # \dfrac = \frac
        (r"... = \boxed{0.5}", r"\frac{1}{2}", 1.0),  # the same number written otherwise
        (r"\boxed{3\sqrt{13}}", r"3\sqrt{13}", 1.0),
        (r"\boxed{\sqrt{117}}", r"3\sqrt{13}", 1.0),  # sqrt(117) = 3 sqrt(13)
        (r"\boxed{4}", r"\frac{14}{3}", 0.0),
        (r"\boxed{p+q}", "p - q", 0.0),
        (r"the answer is 14/3", r"\frac{14}{3}", 0.0),  # no box: nothing committed to
    ],
)
def test_math_reward_compares_answers_as_mathematics(response, answer, score) -> None:
    assert math_reward(response, answer) == score


def test_exact_match_compares_the_final_answer_as_text() -> None:
    from megarl.data.rewards import exact_match_reward

    assert exact_match_reward(r"I pick \boxed{Evelyn}.", "Evelyn") == 1.0
    assert exact_match_reward("thinking...\n#### Carla", "Carla") == 1.0
    assert exact_match_reward(" Evelyn. ", "Evelyn") == 1.0
    assert exact_match_reward("Evelyn or Carla", "Evelyn") == 0.0


# --- data.reward=auto: a reward per data_source --------------------------------------------


def test_auto_scores_each_row_by_its_data_source() -> None:
    choice = choose_reward("auto", task="files")
    scored = score_samples(
        choice,
        [r"\boxed{\frac{1}{2}}", r"\boxed{0.5}", "#### 7", "7 apples", "\\boxed{7}"],
        [r"\frac{1}{2}", r"\frac{1}{2}", "7", "7", "7"],
        ["HuggingFaceH4/MATH-500", "lighteval/MATH", "openai/gsm8k", "", "openai/gsm8k"],
    )
    # MATH rows by their box (0.5 = 1/2); GSM8K and source-less rows by their final number
    assert scored.rewards == (1.0, 1.0, 1.0, 1.0, 1.0)
    assert choice.for_source("openai/gsm8k").name == "gsm8k"
    assert choice.for_source("lighteval/MATH").name == "math"
    assert choice.for_source("").name == "gsm8k"


def test_auto_refuses_a_data_source_it_has_no_reward_for() -> None:
    with pytest.raises(ValueError, match="data_source 'my/code_tasks' has no built-in reward"):
        choose_reward("auto", task="files").for_source("my/code_tasks")


def test_a_named_reward_or_the_arithmetic_task_ignores_data_source() -> None:
    assert choose_reward("math", task="files").for_source("openai/gsm8k").name == "math"
    assert choose_reward("auto", task="arithmetic").for_source("x").name == "exact_last_number"


def test_auto_failure_messages_name_the_reward_it_chose() -> None:
    choice = RewardChoice("auto", None)
    with pytest.raises(RewardFunctionError, match=r"^data\.reward=auto \(gsm8k\): sample 0"):
        score_samples(choice, ["7"], ["seven"], ["openai/gsm8k"])


QUITS = """
from megarl.data.rewards import Reward, RewardChoice, score_samples

def quits(response, answer):
    import os
    os._exit(0)

choice = RewardChoice("m:quits", Reward("m:quits", quits))
for timeout_s in (None, 5.0):  # in the caller's thread, and in the timed one
    scored = score_samples(choice, ["a"], ["1"], None, "zero", 1, timeout_s)
    print(scored.failures, scored.first_failure, flush=True)
"""


def test_a_reward_function_calling_os_exit_fails_its_sample_in_either_thread() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", QUITS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    assert all(
        line.startswith("1 data.reward=m:quits: sample 0 (step 1) raised os._exit(0)")
        for line in lines
    )

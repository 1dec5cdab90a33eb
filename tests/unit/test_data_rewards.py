"""Reward extraction and scoring, including the edge cases models actually produce."""

from __future__ import annotations

import pytest

from megarl.data.numbers import normalize_number, numbers_equal
from megarl.data.rewards import (
    REWARD_FNS,
    exact_match_last_number,
    extract_gsm8k_answer,
    extract_last_number,
    get_reward_fn,
    gsm8k_reward,
)


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
    assert set(REWARD_FNS) == {"exact_last_number", "gsm8k"}
    assert get_reward_fn("gsm8k") is gsm8k_reward
    assert get_reward_fn("exact_last_number") is exact_match_last_number


def test_unknown_reward_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="exact_last_number, gsm8k") as info:
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

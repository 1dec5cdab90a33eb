"""Prompts + rollout.max_new_tokens against the context the rollout can use: plain ints."""

from __future__ import annotations

import pytest

from megarl.config.context import check_prompts_fit, context_limit, overlong, prompt_budget
from megarl.config.schema import ConfigError


def test_prompts_that_fit_exactly_pass():
    check_prompts_fit([10, 500], 12, context_limit(512, "hf", None))


def test_prompts_that_do_not_fit_are_counted_and_the_longest_named():
    with pytest.raises(ConfigError) as info:
        check_prompts_fit([10, 501, 700, 20], 12, context_limit(512, "hf", None))
    message = str(info.value)
    assert message.startswith("2 of 4 prompts do not fit: the longest has 700 tokens")
    assert "rollout.max_new_tokens=12 > 512 tokens (the model's max_position_embeddings" in message
    assert "rollout.max_model_len" not in message  # not a key the hf engine reads


@pytest.mark.parametrize(
    ("engine", "max_model_len", "tokens"),
    [
        ("hf", 100, 512),  # only vLLM reads rollout.max_model_len
        ("vllm", None, 512),
        ("vllm", 100, 100),
        ("vllm", 1024, 512),  # longer than the model: the model's limit (vLLM refuses it)
    ],
)
def test_the_limit_is_the_shorter_of_the_model_and_vllm_max_model_len(
    engine, max_model_len, tokens
):
    assert context_limit(512, engine, max_model_len).tokens == tokens


def test_a_vllm_max_model_len_limit_says_it_can_be_raised():
    with pytest.raises(ConfigError) as info:
        check_prompts_fit([95], 12, context_limit(512, "vllm", 100))
    message = str(info.value)
    assert "(rollout.max_model_len=100)" in message
    assert "raise rollout.max_model_len (the model allows 512)" in message


def test_the_prompt_budget_is_the_context_left_or_max_prompt_length_if_smaller():
    limit = context_limit(512, "hf", None)
    assert prompt_budget(limit, 12, None) == 500
    assert prompt_budget(limit, 12, 64) == 64
    assert prompt_budget(limit, 12, 10_000) == 500
    assert overlong([10, 64, 65, 501], 64) == [2, 3]


def test_prompts_over_max_prompt_length_are_refused_naming_it_and_the_filter():
    with pytest.raises(ConfigError) as info:
        check_prompts_fit([10, 80, 90], 12, context_limit(512, "hf", None), max_prompt_length=64)
    message = str(info.value)
    assert message.startswith("2 of 3 prompts are longer than data.max_prompt_length=64 tokens")
    assert "(the longest has 90)" in message
    assert message.endswith("or drop them with data.filter_overlong_prompts=true")

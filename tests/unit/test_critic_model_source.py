"""``critic.model.path``'s rules on plain data: which folders can start the critic, and where
its value head starts (:mod:`megarl.critic.model_source`)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.models import TINY_HF_CONFIG

from megarl.critic.model_source import (
    CriticModelError,
    check_same_architecture,
    decide_value_head,
    first_spec_difference,
)
from megarl.models.spec import spec_from_hf_config

ACTOR = spec_from_hf_config(TINY_HF_CONFIG)
"""The tiny Llama's: 4 layers, hidden 64, FFN 96, 4 heads of 16, 2 KV heads, vocab 384."""
WHERE = "critic.model.path=/x"


def test_the_actors_own_spec_has_no_difference():
    assert first_spec_difference(ACTOR, ACTOR) is None
    check_same_architecture(WHERE, ACTOR, ACTOR)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_size": 128}, "hidden_size 128 differs from the actor's 64"),
        ({"num_layers": 2}, "num_layers 2 differs from the actor's 4"),
        ({"vocab_size": 512}, "vocab_size 512 differs from the actor's 384"),
        ({"rope_theta": 1e6}, "rope_theta 1000000.0 differs from the actor's 10000.0"),
        ({"family": "qwen2", "qkv_bias": True}, "family qwen2 differs from the actor's llama"),
        # two fields differ: the first in declaration order is named
        ({"num_layers": 2, "hidden_size": 32}, "hidden_size 32 differs"),
    ],
)
def test_a_different_architecture_is_refused_naming_the_first_field(changes, needle):
    critic = dataclasses.replace(ACTOR, **changes)
    with pytest.raises(CriticModelError, match="^critic.model.path=/x: ") as info:
        check_same_architecture(WHERE, ACTOR, critic)
    assert needle in str(info.value)


def test_tied_embeddings_may_differ_since_the_critic_has_no_output_layer():
    critic = dataclasses.replace(ACTOR, tie_embeddings=True)
    assert first_spec_difference(ACTOR, critic) is None


def test_a_scalar_score_weight_is_the_head():
    source = decide_value_head(WHERE, {"score.weight": (1, 64)}, None, 64, 0.0)
    assert source.from_checkpoint
    assert source.description == "value head from critic.model.path=/x (score.weight)"


def test_a_zero_score_bias_is_accepted():
    shapes = {"score.weight": (1, 64), "score.bias": (1,)}
    assert decide_value_head(WHERE, shapes, [0.0], 64, 0.0).from_checkpoint


def test_a_nonzero_score_bias_is_refused():
    shapes = {"score.weight": (1, 64), "score.bias": (1,)}
    with pytest.raises(CriticModelError, match=r"score.bias is nonzero \(\[0.25\]\)"):
        decide_value_head(WHERE, shapes, [0.25], 64, 0.0)


@pytest.mark.parametrize("shape", [(2, 64), (1, 32), (64,), (1, 64, 1)])
def test_a_score_weight_of_another_shape_is_refused(shape):
    with pytest.raises(CriticModelError) as info:
        decide_value_head(WHERE, {"score.weight": shape}, None, 64, 0.0)
    assert str(info.value) == (
        f"{WHERE}: score.weight has shape {list(shape)}; a value head needs [1, 64] "
        "(a scalar head: num_labels=1)"
    )


@pytest.mark.parametrize(
    ("init_std", "needle"),
    [(0.0, "value head zero-initialised"), (0.02, "critic.value_head_init_std=0.02")],
)
def test_without_score_weight_the_head_is_fresh(init_std, needle):
    shapes = {"model.embed_tokens.weight": (384, 64), "lm_head.weight": (384, 64)}
    source = decide_value_head(WHERE, shapes, None, 64, init_std)
    assert not source.from_checkpoint
    assert needle in source.description and "has no score.weight" in source.description

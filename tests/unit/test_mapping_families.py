"""Each family's table names and sizes exactly the tensors a real ``transformers`` model has.

Adding a family means adding a table: this test builds the family's HF model from a tiny config
and compares every name and shape, so a table that misses or invents a tensor fails here.
"""

from __future__ import annotations

import pytest

from megarl.models import mapping
from megarl.models.spec import ModelSpecError, spec_from_hf_config

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_table_matches_transformers_state_dict(family, tied):
    from megarl.models.random_init import build_random_hf_model

    cfg = dict(TINY, model_type=family, tie_word_embeddings=tied)
    if family == "mistral":
        cfg["sliding_window"] = None
    if family == "qwen3":
        cfg["head_dim"] = 16  # Qwen3 sets head_dim apart from hidden / heads (here 8)
    model = build_random_hf_model(cfg, seed=0)
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight")
    spec = spec_from_hf_config(model.config)
    shapes = {}
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            shapes.update(zip(rule.hf_names(layer), mapping.hf_shapes(rule, spec), strict=True))
    assert sorted(shapes) == sorted(state) == sorted(mapping.expected_hf_names(spec))
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    assert spec.qkv_bias == (family == "qwen2")
    assert spec.qk_norm == (family == "qwen3")
    assert spec.num_parameters() == sum(t.numel() for t in state.values())


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ],
)
def test_unmapped_features_are_refused(extra, words):
    with pytest.raises(ModelSpecError, match=words):
        spec_from_hf_config(dict(TINY, **extra))


def test_qwen2_sliding_window_off_by_default_is_accepted():
    spec = spec_from_hf_config(
        dict(TINY, model_type="qwen2", sliding_window=16, use_sliding_window=False)
    )
    assert spec.qkv_bias


def test_rule_with_unknown_dim_is_rejected():
    with pytest.raises(ValueError, match="unknown dims"):
        mapping.ParamRule("x.weight", ("y.weight",), "column", (("hidden", "heads"),))

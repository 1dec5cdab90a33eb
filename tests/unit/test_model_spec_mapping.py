"""The HF <-> Megatron layout tables round-trip bitwise at every TP size, and specs validate."""

from __future__ import annotations

import pytest
import torch

from megarl.models import mapping
from megarl.models.spec import ModelSpecError, spec_from_hf_config

LLAMA = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _random_hf_tensors(spec):
    gen = torch.Generator().manual_seed(0)
    h, d = spec.hidden_size, spec.head_dim
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (spec.num_heads * d, h),
                p + "self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, spec.num_heads * d),
                p + "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
                p + "mlp.up_proj.weight": (spec.ffn_hidden_size, h),
                p + "mlp.down_proj.weight": (h, spec.ffn_hidden_size),
            }
        )
        if spec.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (spec.num_heads * d,),
                    p + "self_attn.k_proj.bias": (spec.num_kv_heads * d,),
                    p + "self_attn.v_proj.bias": (spec.num_kv_heads * d,),
                }
            )
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_bitwise(family, tp):
    spec = spec_from_hf_config(dict(LLAMA, model_type=family))
    hf = _random_hf_tensors(spec)
    assert sorted(mapping.expected_hf_names(spec)) == sorted(hf)
    for rule in mapping.rules_for(spec):
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            names = rule.hf_names(layer)
            shards = [
                mapping.to_mcore_shard(rule, [hf[n] for n in names], spec, r, tp) for r in range(tp)
            ]
            assert len({s.shape for s in shards}) == 1
            for name, tensor in zip(names, mapping.to_hf(rule, shards, spec), strict=True):
                assert torch.equal(tensor, hf[name]), (name, tp)


@pytest.mark.parametrize(
    "hf_config",
    [
        dict(LLAMA, model_type="qwen2"),
        dict(
            LLAMA,
            model_type="qwen3_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            head_dim=8,
        ),
        dict(
            LLAMA,
            model_type="qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        ),
    ],
    ids=["qwen2", "qwen3_moe", "qwen2_moe"],
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_whole_megatron_parameter_from_tp_shards_is_the_tp1_shard(hf_config, tp):
    """What the exporter sends a rollout-side Megatron engine (the TP=1 parameter, no HF
    split) is bitwise what loading the HF tensors at TP=1 gives, in the shape the plan states;
    a vocabulary matrix keeps its real rows."""
    spec = spec_from_hf_config(hf_config)
    gen = torch.Generator().manual_seed(1)
    for rule in mapping.rules_for(spec):
        shapes = mapping.hf_shapes(rule, spec)
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            hf = [torch.randn(shape, generator=gen) for shape in shapes]
            shards = [mapping.to_mcore_shard(rule, hf, spec, r, tp) for r in range(tp)]
            full = mapping.to_mcore_full(rule, shards, spec)
            expected = mapping.to_mcore_shard(rule, hf, spec, 0, 1)[: full.shape[0]]
            assert torch.equal(full, expected), (rule.mcore_name(layer), tp)
            assert tuple(full.shape) == mapping.mcore_full_shape(rule, spec), rule.mcore
            if rule.layout == "vocab":
                assert full.shape[0] == spec.vocab_size


def test_qkv_shard_holds_whole_groups_in_megatron_order():
    spec = spec_from_hf_config(LLAMA)  # 8 heads, 4 groups, head_dim 4
    d = spec.head_dim
    q = torch.arange(8 * d).float().unsqueeze(1)
    k = 1000 + torch.arange(4 * d).float().unsqueeze(1)
    v = 2000 + torch.arange(4 * d).float().unsqueeze(1)
    rule = next(r for r in mapping.rules_for(spec) if r.layout == "qkv")
    shard1 = mapping.to_mcore_shard(rule, [q, k, v], spec, tp_rank=1, tp=2).squeeze(1)
    # rank 1 holds groups 2 and 3: [q heads 4,5 | k head 2 | v head 2 | q heads 6,7 | k3 | v3]
    expected_first_group = torch.cat(
        [q[4 * d : 6 * d], k[2 * d : 3 * d], v[2 * d : 3 * d]]
    ).squeeze(1)
    assert torch.equal(shard1[: 4 * d], expected_first_group)


def test_vocab_padding_is_zero_and_dropped_on_export():
    spec = spec_from_hf_config(LLAMA)
    assert spec.padded_vocab_size(2) == 256
    emb = torch.randn(100, 32)
    rule = mapping.rules_for(spec)[0]
    shards = [mapping.to_mcore_shard(rule, [emb], spec, r, 2) for r in range(2)]
    assert shards[1].shape == (128, 32) and torch.all(shards[1][100 - 128 :] == 0)
    assert torch.equal(mapping.to_hf(rule, shards, spec)[0], emb)


@pytest.mark.parametrize("rows", [99, 101, 128])
def test_vocab_rows_disagreeing_with_the_config_are_refused_not_padded(rows):
    spec = spec_from_hf_config(LLAMA)
    rule = mapping.rules_for(spec)[0]
    with pytest.raises(
        ModelSpecError, match=f"model.embed_tokens.weight has {rows} rows but vocab_size=100"
    ):
        mapping.to_mcore_shard(rule, [torch.randn(rows, 32)], spec, 0, 2)


@pytest.mark.parametrize(
    ("tp", "pp", "needle"),
    [
        (3, 1, "actor.tp=3 does not divide the model's 8 attention heads"),
        (8, 1, "actor.tp=8 does not divide the model's 4 key/value heads"),
        (1, 3, "actor.pp=3 does not divide the model's 2 layers"),
    ],
)
def test_parallel_layout_errors(tp, pp, needle):
    spec = spec_from_hf_config(LLAMA)
    with pytest.raises(ModelSpecError, match=needle):
        spec.check_parallelism(tp, pp)


def test_unsupported_family_and_rope():
    with pytest.raises(ModelSpecError, match="model_type='gpt2'"):
        spec_from_hf_config(dict(LLAMA, model_type="gpt2"))
    with pytest.raises(ModelSpecError, match="rope_type='yarn'"):
        spec_from_hf_config(dict(LLAMA, rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}))


def test_transformers5_rope_parameters():
    spec = spec_from_hf_config(
        dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    )
    assert spec.rope_theta == 100000.0


def test_interleaved_training_names_what_it_cannot_train_yet():
    from megarl.models.spec import vpp_training_problem

    assert vpp_training_problem(is_moe=False, lora=False, critic=False, packed=True) is None
    problem = vpp_training_problem(is_moe=True, lora=False, critic=True, packed=False)
    assert problem is not None and problem.startswith("actor.vpp > 1")
    for named in ("mixture-of-experts", "critic", "actor.pack_sequences=false", "actor.vpp=1"):
        assert named in problem
    assert "LoRA (" not in problem

"""Engine-TP shards computed from Megatron shards equal vLLM's own slicing of the HF tensors."""

from __future__ import annotations

import pytest
import torch

from megarl.export.target_layout import (
    needed_mcore_ranks,
    vllm_padded_vocab,
    vllm_param_name,
    vllm_shard_from_hf,
    vllm_shard_from_mcore,
)
from megarl.models import mapping
from megarl.models.spec import spec_from_hf_config

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _hf(spec):
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rule in mapping.rules_for(spec):
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            for name, shape in zip(
                rule.hf_names(layer), mapping.hf_shapes(rule, spec), strict=True
            ):
                out[name] = torch.randn(shape, generator=gen)
    return out


def _cases(spec, hf, mcore_tp):
    for rule in mapping.rules_for(spec):
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            tensors = [hf[n] for n in rule.hf_names(layer)]
            shards = [
                mapping.to_mcore_shard(rule, tensors, spec, m, mcore_tp) for m in range(mcore_tp)
            ]
            yield rule, layer, tensors, shards


@pytest.mark.parametrize(
    ("family", "kv_heads", "mcore_tp", "engine_tp"),
    [
        ("llama", 4, 1, 2),
        ("llama", 4, 2, 2),
        ("llama", 4, 4, 2),
        ("llama", 4, 2, 4),
        ("llama", 4, 2, 1),
        ("qwen2", 4, 2, 2),
        ("qwen2", 4, 4, 1),
        ("llama", 2, 2, 4),
        ("qwen2", 2, 1, 8),
        ("llama", 2, 2, 8),  # KV heads replicated
    ],
)
def test_from_megatron_equals_vllm_slicing(family, kv_heads, mcore_tp, engine_tp):
    spec = spec_from_hf_config(dict(BASE, model_type=family, num_key_value_heads=kv_heads))
    hf = _hf(spec)
    for rule, _, tensors, shards in _cases(spec, hf, mcore_tp):
        for rank in range(engine_tp):
            needed = needed_mcore_ranks(rule, spec, mcore_tp, engine_tp, rank)
            got = vllm_shard_from_mcore(
                rule, {m: shards[m] for m in needed}, spec, mcore_tp, engine_tp, rank
            )
            want = vllm_shard_from_hf(rule, tensors, spec, engine_tp, rank)
            assert torch.equal(got, want), (rule.mcore, rank)
            same_vocab_split = vllm_padded_vocab(
                spec.vocab_size, engine_tp
            ) == spec.padded_vocab_size(mcore_tp)
            if mcore_tp == engine_tp and (rule.layout != "vocab" or same_vocab_split):
                assert needed == (rank,), rule.mcore  # own shard only: no gather


def test_engine_tp2_shards_are_hf_chunks_as_vllm_slices_them():
    spec = spec_from_hf_config(dict(BASE, model_type="qwen2"))
    hf = _hf(spec)
    p = "model.layers.0."
    q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    qb, kb, vb = (hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv")
    gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
    emb = hf["model.embed_tokens.weight"]
    padded = torch.cat([emb, emb.new_zeros(vllm_padded_vocab(100, 2) - 100, 32)])
    assert padded.shape[0] == 128  # 100 -> multiple of 64
    expected = {
        "self_attention.linear_qkv.weight": lambda r: torch.cat(
            [q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]]
        ),
        "self_attention.linear_qkv.bias": lambda r: torch.cat(
            [qb.chunk(2)[r], kb.chunk(2)[r], vb.chunk(2)[r]]
        ),
        "mlp.linear_fc1.weight": lambda r: torch.cat([gate.chunk(2)[r], up.chunk(2)[r]]),
        "mlp.linear_fc2.weight": lambda r: hf[p + "mlp.down_proj.weight"].chunk(2, dim=1)[r],
        "self_attention.linear_proj.weight": lambda r: hf[p + "self_attn.o_proj.weight"].chunk(
            2, dim=1
        )[r],
        "input_layernorm.weight": lambda r: hf[p + "input_layernorm.weight"],
        "embedding.word_embeddings.weight": lambda r: padded.chunk(2)[r],
    }
    seen = set()
    for rule, _layer, _, shards in _cases(spec, hf, mcore_tp=2):
        key = rule.mcore.replace("decoder.layers.{layer}.", "")
        if key not in expected:
            continue
        seen.add(key)
        for r in range(2):
            needed = needed_mcore_ranks(rule, spec, 2, 2, r)
            got = vllm_shard_from_mcore(rule, {m: shards[m] for m in needed}, spec, 2, 2, r)
            assert torch.equal(got, expected[key](r)), (key, r)
    assert seen == set(expected)


def test_equal_tp_and_aligned_vocab_reads_only_own_shards():
    """SmolLM2-like vocabulary (a multiple of 128 x TP): both pad alike, so even the embedding
    needs no peer shard."""
    spec = spec_from_hf_config(dict(BASE, vocab_size=512))
    for rule in mapping.rules_for(spec):
        for rank in range(2):
            assert needed_mcore_ranks(rule, spec, 2, 2, rank) == (rank,), rule.mcore


def test_vllm_names_are_the_stacked_params():
    spec = spec_from_hf_config(dict(BASE, model_type="qwen2"))
    names = {vllm_param_name(r, 0 if r.per_layer else None) for r in mapping.rules_for(spec)}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names


def test_bad_engine_tp_is_named():
    spec = spec_from_hf_config(BASE)
    rule = next(r for r in mapping.rules_for(spec) if r.layout == "qkv")
    with pytest.raises(ValueError, match="rollout.tp=3"):
        needed_mcore_ranks(rule, spec, 1, 3, 0)


def test_local_engine_shards_need_no_peer_when_aligned():
    from megarl.export.target_layout import local_engine_shards

    spec = spec_from_hf_config(dict(BASE, vocab_size=512))
    hf = _hf(spec)
    for rank in range(2):
        params = [(rule, layer, shards[rank]) for rule, layer, _, shards in _cases(spec, hf, 2)]
        got = dict(local_engine_shards(params, spec, 2, rank, 2))
        for rule, layer, tensors, _ in _cases(spec, hf, 2):
            want = vllm_shard_from_hf(rule, tensors, spec, 2, rank)
            assert torch.equal(got[vllm_param_name(rule, layer)], want)
    misaligned = spec_from_hf_config(BASE)  # vocab 100: vLLM pads to 128, Megatron to 256
    params = [(r, layer, s[1]) for r, layer, _, s in _cases(misaligned, _hf(misaligned), 2)]
    with pytest.raises(ValueError, match="embed_tokens"):
        dict(local_engine_shards(params, misaligned, 2, 1, 2))

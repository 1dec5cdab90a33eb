"""The export schedule: complete, ordered, budget-bounded, owners as Megatron assigns layers."""

from __future__ import annotations

import pytest
import torch

from megarl.export.checksum import compare_checksums, tensor_checksum
from megarl.export.plan import owner_pp_rank, plan_buckets, plan_export
from megarl.models import mapping
from megarl.models.spec import spec_from_hf_config

CFG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def _megatron_offset(vp_stage: int, pp_rank: int, num_layers: int, pp: int, vpp: int) -> int:
    """Megatron's get_transformer_layer_offset (even split, interleaved), restated."""
    return vp_stage * (num_layers // vpp) + pp_rank * (num_layers // (pp * vpp))


@pytest.mark.parametrize(("pp", "vpp"), [(1, 1), (2, 1), (4, 1), (2, 2), (2, 4), (4, 2)])
def test_owner_matches_megatron_layer_offsets(pp, vpp):
    num_layers, per_chunk = 8, 8 // (pp * vpp)
    for pp_rank in range(pp):
        for vp in range(vpp):
            start = _megatron_offset(vp, pp_rank, num_layers, pp, vpp)
            for layer in range(start, start + per_chunk):
                assert owner_pp_rank(layer, num_layers, pp, vpp) == pp_rank


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("budget", [1, 3000, 10_000, 10**9])
def test_plan_is_complete_ordered_and_bounded(tied, budget):
    spec = spec_from_hf_config(dict(CFG, tie_word_embeddings=tied))
    plan = plan_export(spec, tp=2, pp=2, vpp=2, element_size=4, bucket_bytes=budget)
    items = [i for b in plan.buckets for i in b.items]
    names = [n for i in items for n in i.hf_names]
    assert sorted(names) == sorted(mapping.expected_hf_names(spec))
    assert len(set(names)) == len(names)
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == ("model.norm.weight" if tied else "lm_head.weight")
    layers = [i.layer for i in items if i.layer is not None]
    assert layers == sorted(layers)
    for bucket in plan.buckets:
        assert bucket.nbytes == sum(i.nbytes for i in bucket.items)
        assert bucket.nbytes <= budget or len(bucket.items) == 1
    assert plan.total_bytes == spec.num_parameters() * 4
    first, last = plan.buckets[0].items[0], plan.buckets[-1].items[-1]
    assert first.pp_rank == 0 and last.pp_rank == 1
    if budget == 10**9:
        assert len(plan.buckets) == 1


@pytest.mark.parametrize("tied", [False, True])
def test_in_megatron_layout_each_item_is_one_whole_parameter_of_the_same_bytes(tied):
    """What a Megatron engine receives: one tensor per item, named as the TP=1 model's parameter,
    of the bytes the HF tensors would have had (so the buckets and their bound are unchanged)."""
    spec = spec_from_hf_config(dict(CFG, tie_word_embeddings=tied))
    plan = plan_export(spec, tp=2, pp=2, vpp=1, element_size=4, bucket_bytes=3000)
    items = [i for b in plan.buckets for i in b.items]
    sent = [i.sent(megatron_layout=True) for i in items]
    assert all(len(one) == 1 for one in sent)
    names = [name for ((name, _),) in sent]
    assert len(set(names)) == len(names)
    assert names[0] == "embedding.word_embeddings.weight"
    assert ("output_layer.weight" in names) is not tied
    assert "decoder.layers.7.self_attention.linear_qkv.weight" in names
    for item, ((_, shape),) in zip(items, sent, strict=True):
        assert 4 * int(torch.Size(shape).numel()) == item.nbytes, item.rule.mcore
        assert item.sent(megatron_layout=False) == tuple(
            zip(item.hf_names, item.hf_shapes, strict=True)
        )


def test_vocab_item_counts_padding_when_gathered():
    spec = spec_from_hf_config(CFG)
    plan = plan_export(spec, tp=2, pp=1, vpp=1, element_size=2, bucket_bytes=10**9)
    embed = plan.buckets[0].items[0]
    assert embed.nbytes == 100 * 32 * 2
    assert embed.gathered_nbytes == spec.padded_vocab_size(2) * 32 * 2
    norm = next(i for b in plan.buckets for i in b.items if i.rule.layout == "replicated")
    assert norm.gathered_nbytes == 0
    assert plan.memory_bound() == plan.bucket_bytes + embed.gathered_nbytes


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checksum_detects_changed_and_moved_values(dtype):
    t = torch.randn(1000, dtype=torch.float32).to(dtype)
    base = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == base
    changed = t.clone()
    changed[7] = changed[7] * 2 + 1
    assert tensor_checksum(changed) != base
    swapped = t.clone()
    swapped[[3, 900]] = t[[900, 3]]
    assert t[3] == t[900] or tensor_checksum(swapped) != base
    held = {"w": tensor_checksum(t.float().to(dtype))}  # an fp32 engine, read in the sent dtype
    assert compare_checksums({"w": base}, held) == []
    assert compare_checksums({"w": base, "x": (0, 0)}, held) == ["x"]


def test_checksum_steps_and_engine_mismatch_is_an_error_naming_the_tensor():
    from types import SimpleNamespace

    from megarl.export.sync import ExportChecksumError, is_checksum_step, verify_engine_checksums

    assert [s for s in range(1, 7) if is_checksum_step(s, 3)] == [3, 6]
    assert not any(is_checksum_step(s, 0) for s in range(1, 7))
    weights = {"a": torch.randn(4, 4), "b": torch.randn(3)}
    stream = SimpleNamespace(
        sent_checksums={k: tensor_checksum(v) for k, v in weights.items()}, dtype=torch.float32
    )

    def engine_holding(held: dict) -> SimpleNamespace:
        return SimpleNamespace(
            weight_checksums=lambda dtype: {
                k: tensor_checksum(v.to(dtype)) for k, v in held.items()
            }
        )

    verify_engine_checksums(stream, engine_holding(weights))
    stale = dict(weights, b=weights["b"] + 1)
    with pytest.raises(ExportChecksumError, match="'b' differs"):
        verify_engine_checksums(stream, engine_holding(stale))


def test_experts_are_owned_by_their_expert_parallel_rank():
    """Expert e of E lives on expert-parallel rank e // (E / ep); everything else on all ranks."""
    spec = spec_from_hf_config(
        dict(
            CFG,
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            head_dim=8,
        )
    )
    items = [i for b in plan_export(spec, 1, 1, 1, 4, 10**9, ep=4).buckets for i in b.items]
    names = {n: i.ep_rank for i in items for n in i.hf_names}
    assert sorted(names) == sorted(mapping.expected_hf_names(spec))
    assert names["model.layers.2.mlp.experts.5.up_proj.weight"] == 2
    assert names["model.layers.7.mlp.experts.0.down_proj.weight"] == 0
    assert names["model.layers.7.mlp.experts.7.gate_proj.weight"] == 3
    assert names["model.layers.2.mlp.gate.weight"] is None
    assert names["model.layers.2.self_attn.q_norm.weight"] is None

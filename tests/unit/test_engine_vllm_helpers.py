"""The vLLM engine's pure parts, which run without vLLM (the engine itself:
tests/integration/test_vllm_engine.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers.models import tiny_llama_model

from megarl.engines.base import request_seed
from megarl.engines.tensor_transport import SharedTensorFile, TensorMeta, read_tensors
from megarl.engines.vllm import EngineStartupError, check_load_method, sampled_token_logprobs
from megarl.engines.vllm_weights import (
    FusedGroupBatcher,
    canonical_weight_name,
    check_weight,
    fused_group,
    read_checkpoint_shapes,
    write_peft_adapter,
)

# peft reads a transformers property that is deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def tiny_llama(tie: bool):
    pytest.importorskip("transformers")
    return tiny_llama_model(0, vocab_size=64, tie_word_embeddings=tie)


def test_request_seeds_are_reproducible_and_distinct():
    seeds = [request_seed(7, i) for i in range(64)]
    assert seeds == [request_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64
    assert request_seed(8, 0) != request_seed(7, 0)
    assert all(0 <= s < 2**63 for s in seeds)


def test_sampled_token_logprobs_picks_each_sampled_token():
    def logprob(value: float) -> SimpleNamespace:
        return SimpleNamespace(logprob=value)

    positions = [{4: logprob(-0.5), 9: logprob(-0.1)}, {2: logprob(-2.0)}]
    assert sampled_token_logprobs([4, 2], positions) == (-0.5, -2.0)
    with pytest.raises(RuntimeError, match="no logprobs"):
        sampled_token_logprobs([4], None)
    with pytest.raises(RuntimeError, match="1 logprobs for 2 tokens"):
        sampled_token_logprobs([4, 2], positions[:1])


def test_tied_lm_head_is_sent_as_the_embedding():
    assert canonical_weight_name("lm_head.weight", tied_embeddings=True) == (
        "model.embed_tokens.weight"
    )
    assert canonical_weight_name("lm_head.weight", tied_embeddings=False) == "lm_head.weight"


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_shapes_accept_every_state_dict_name(tmp_path, tie):
    model = tiny_llama(tie)
    model.save_pretrained(tmp_path)
    shapes = read_checkpoint_shapes(str(tmp_path))
    assert shapes == {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, tensor in model.state_dict().items():
        check_weight(name, tensor, shapes)
    with pytest.raises(ValueError, match="model.layers.5.mlp.up_proj.weight"):
        check_weight("model.layers.5.mlp.up_proj.weight", torch.zeros(1), shapes)
    with pytest.raises(ValueError, match="model.norm.weight"):
        check_weight("model.norm.weight", torch.zeros(3), shapes)


def test_no_local_checkpoint_means_no_local_checks(tmp_path):
    assert read_checkpoint_shapes("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert read_checkpoint_shapes(str(tmp_path)) is None
    check_weight("anything", torch.zeros(1), None)


PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def layer_tensors(layer: int) -> list[tuple[str, torch.Tensor]]:
    """One layer's HF tensors in the exporter's order (4 floats each: 16 bytes)."""
    names = [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    return [(f"model.layers.{layer}.{n}.weight", torch.full((4,), float(layer))) for n in names]


def test_fused_group_names_the_vllm_parameter_and_the_part():
    assert fused_group("model.layers.3.self_attn.k_proj.weight", PACKED) == (
        "model.layers.3.self_attn.qkv_proj.weight",
        "qkv_proj",
        "k_proj",
    )
    assert fused_group("model.layers.3.mlp.up_proj.bias", PACKED) == (
        "model.layers.3.mlp.gate_up_proj.bias",
        "gate_up_proj",
        "up_proj",
    )
    assert fused_group("model.layers.3.self_attn.o_proj.weight", PACKED) is None


@pytest.mark.parametrize("max_bytes", [1, 16, 40, 100, 10_000])
def test_buckets_never_split_a_fused_group_at_any_budget(max_bytes):
    stream = layer_tensors(0) + layer_tensors(1)
    batcher = FusedGroupBatcher(PACKED, max_bytes)
    buckets = list(batcher.buckets(stream))
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in stream)
    for bucket in buckets:
        names = [n for n, _ in bucket]
        for name in names:
            group = fused_group(name, PACKED)
            if group is not None:  # every part of its group is in the same bucket
                assert all(name.replace(group[2], part) in names for part in PACKED[group[1]])
        if max_bytes <= 16:  # one tensor or one whole group per bucket
            assert len(bucket) in (1, 2, 3)
    assert not batcher.pending


def test_a_group_split_across_calls_waits_for_its_last_part():
    batcher = FusedGroupBatcher(PACKED, 10_000)
    stream = layer_tensors(0)
    first = [n for b in batcher.buckets(stream[:3]) for n, _ in b]  # norm, q, k
    assert first == ["model.layers.0.input_layernorm.weight"]
    assert batcher.pending_names() == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    second = [n for b in batcher.buckets(stream[3:]) for n, _ in b]
    assert second[:3] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert not batcher.pending


def test_shared_file_hands_tensors_over_bitwise():
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.arange(7, dtype=torch.int64)),
        ("c", torch.randn(4, 2).to(torch.bfloat16).t()),
    ]  # non-contiguous
    shared = SharedTensorFile()
    try:
        for _ in range(2):  # the file is reused, and grows for a bigger bucket
            records = [TensorMeta.from_wire(r.to_wire()) for r in shared.write(tensors)]
            got = dict(read_tensors(shared.path, records))
            for name, tensor in tensors:
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
            tensors = [*tensors, ("d", torch.randn(1000))]
    finally:
        shared.close()


def test_written_adapter_loads_in_peft_as_the_same_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_llama(tie=False)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    trained = peft.get_peft_model(copy.deepcopy(base), config)
    state = peft.get_peft_model_state_dict(trained)

    folder = tmp_path / "adapter"
    assert write_peft_adapter(folder, state.items(), 2, 4.0, ["q_proj", "v_proj"]) == len(state)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    ids_BT = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids_BT).logits, trained(ids_BT).logits)


def test_adapter_writer_rejects_non_lora_names(tmp_path):
    with pytest.raises(ValueError, match="q_proj.weight"):
        write_peft_adapter(
            tmp_path / "a", [("model.q_proj.weight", torch.zeros(1))], 2, 4.0, ["q_proj"]
        )


def test_an_in_place_load_needs_layers_that_still_hold_their_weights():
    from megarl.engines.vllm_worker import _weightless_linear_layers

    def layer(weight: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        module.cpu_linear = lambda x, w, b: x  # a packed CPU kernel of its own
        return module

    kept = torch.nn.Sequential(layer(torch.ones(4, 4)), torch.nn.LayerNorm(4))
    dropped = torch.nn.Sequential(layer(torch.ones(4, 4)), layer(torch.empty(0)))
    assert _weightless_linear_layers(kept) == 0
    assert _weightless_linear_layers(dropped) == 1
    check_load_method("load_weights", {"weightless_linear_layers": 0})
    check_load_method("reload", {"weightless_linear_layers": 1})
    with pytest.raises(EngineStartupError, match="1 linear layers of this vLLM engine hold none"):
        check_load_method("load_weights", {"weightless_linear_layers": 1})

"""The vLLM engine's pure parts, which run without vLLM (the engine itself: tests/gpu)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from megarl.engines.vllm import (
    bucket_by_bytes,
    canonical_weight_name,
    check_weight,
    read_checkpoint_shapes,
    request_seed,
    sampled_token_logprobs,
    write_peft_adapter,
)

# peft reads a transformers property that is deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def tiny_llama(tie: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config).eval()


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


def test_buckets_respect_the_byte_limit_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([4, 4, 10, 1])]
    buckets = list(bucket_by_bytes(tensors, max_bytes=32))
    assert [[name for name, _ in bucket] for bucket in buckets] == [["t0", "t1"], ["t2"], ["t3"]]


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

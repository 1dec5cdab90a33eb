"""VLLMEngine against a real vLLM on CUDA (skipped where vLLM or CUDA is missing).

The CUDA-only branches: bf16, sleep mode, and both weight-load paths on CUDA's own worker (on
CPU the ``load_weights`` path runs under megarl's worker, which keeps the weights). One engine serves the whole module (vLLM's sleep-mode allocator allows
one per process), so every test leaves it awake with the original base weights. The model is a
tiny random Llama saved to a temporary folder, served in bfloat16; references come from
``transformers`` in fp32 on the same weights, so logprob comparisons use a bfloat16-sized
tolerance. The CPU build runs the rest in ``tests/integration/test_vllm_engine.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs CUDA"),
]

from helpers.engines import mean_abs_logprob_diff, random_lora  # noqa: E402
from helpers.models import engine_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from megarl.engines.base import LoraAdapter, SamplingParams  # noqa: E402
from megarl.engines.factory import build_engine  # noqa: E402
from megarl.engines.vllm import VLLMEngine  # noqa: E402

VOCAB = 512
EOS = 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
BF16_LOGPROB_TOLERANCE = 2e-2  # mean |vLLM bf16 - HF fp32| per token
LORA_TARGETS = ["q_proj", "v_proj"]


def random_llama(seed: int) -> LlamaForCausalLM:
    model = engine_llama(seed, VOCAB, hidden_size=256, max_position_embeddings=512)
    with torch.no_grad():  # sharper distributions than the default init, so argmax is stable
        model.lm_head.weight.mul_(20.0)
    return model.to(torch.bfloat16).float()  # exactly representable in the served bf16


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, LlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = random_llama(seed=0)
    model.to(torch.bfloat16).save_pretrained(folder)
    return str(folder), model.float().cuda()


@pytest.fixture(scope="module")
def engine(reference) -> VLLMEngine:
    path, _ = reference
    built = build_engine(
        "vllm",
        model=path,
        gpu_memory_utilization=0.3,
        max_num_seqs=16,
        dtype="bfloat16",
        logprobs_mode="processed_logprobs",  # the tests sample at temperature 0.8
        enable_sleep_mode=True,
        enable_lora=True,
        max_lora_rank=8,
        eos_token_ids=[EOS],
        max_model_len=256,
        skip_tokenizer_init=True,
        enforce_eager=True,
    )
    yield built
    built.close()


def greedy(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


def test_generate_returns_the_interface_logprobs(engine, reference):
    _, model = reference
    params = SamplingParams(temperature=0.8, max_new_tokens=8, seed=0)
    generations = engine.generate(PROMPTS, params)
    assert [g.prompt_ids for g in generations] == [tuple(p) for p in PROMPTS]
    for generation in generations:
        assert 1 <= len(generation.response_ids) <= 8
        assert all(math.isfinite(lp) and lp <= 0 for lp in generation.response_logprobs)
        assert generation.finished == (generation.response_ids[-1] == EOS)
    assert mean_abs_logprob_diff(model, generations, 0.8) < BF16_LOGPROB_TOLERANCE


def test_seeds_are_reproducible_and_groups_differ(engine):
    group = [[7, 8, 9]] * 8
    first = engine.generate(group, SamplingParams(max_new_tokens=8, seed=3))
    assert engine.generate(group, SamplingParams(max_new_tokens=8, seed=3)) == first
    assert len({g.response_ids for g in first}) > 1


def test_top_p_below_one_is_refused(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, SamplingParams(top_p=0.9))


def test_update_weights_changes_output_and_validates_names(engine, reference):
    _, model = reference
    before = engine.generate(PROMPTS, greedy())
    new_model = random_llama(seed=1).cuda()
    state = new_model.state_dict()
    assert engine.update_weights(state.items()) == len(state)
    after = engine.generate(PROMPTS, greedy())
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    assert mean_abs_logprob_diff(new_model, after, 0.0) < BF16_LOGPROB_TOLERANCE

    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(512, 256))])
    engine.update_weights(model.state_dict().items())
    assert engine.generate(PROMPTS, greedy()) == before


@pytest.mark.parametrize("method", ["reload", "load_weights"])
def test_both_weight_load_paths_serve_the_sent_weights(engine, reference, method):
    """On CUDA both paths work; ``benchmarks/bench_engines.py --gpu`` times them."""
    _, model = reference
    before = engine.generate(PROMPTS, greedy())
    engine._load_method = method
    try:
        new_model = random_llama(seed=2).cuda()
        engine.update_weights(new_model.state_dict().items())
        after = engine.generate(PROMPTS, greedy())
        assert mean_abs_logprob_diff(new_model, after, 0.0) < BF16_LOGPROB_TOLERANCE
        engine.update_weights(model.state_dict().items())
    finally:
        engine._load_method = "reload"
    assert engine.generate(PROMPTS, greedy()) == before


def test_lora_adapter_matches_merged_reference(engine, reference):
    _, model = reference
    adapter, merged = random_lora(model, seed=5, targets=LORA_TARGETS, rank=8, alpha=16)

    engine.load_lora_adapter(
        LoraAdapter(adapter, rank=8, alpha=16, target_modules=tuple(LORA_TARGETS))
    )
    assert engine.memory_state().adapter_resident
    generations = engine.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1))
    assert mean_abs_logprob_diff(merged, generations, 1.0) < BF16_LOGPROB_TOLERANCE


def test_sleep_and_wake_report_what_survived(engine, reference):
    _, model = reference
    engine.sleep(1)
    assert engine.memory_state().base_weights_resident
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy())
    assert engine.wake_up().base_weights_resident
    assert engine.generate(PROMPTS, greedy())  # weights came back from host memory

    engine.sleep(2)
    state = engine.wake_up()
    assert not state.base_weights_resident and not state.adapter_resident
    with pytest.raises(RuntimeError, match="resent"):
        engine.generate(PROMPTS, greedy())
    engine.update_weights(model.state_dict().items())
    assert engine.memory_state().base_weights_resident
    base_only = engine.generate(PROMPTS, greedy())
    assert mean_abs_logprob_diff(model, base_only, 0.0) < BF16_LOGPROB_TOLERANCE

"""MegatronEngine on a tiny random Llama in a world of one: what it adds to the engine contract
(the contract itself runs against every engine in ``test_engine_contract.py``).

The central check: its logprobs (left-padded rows over Megatron's static KV cache) equal one
plain, unpadded, uncached forward of prompt+response by the HF model of the same weights, and
its greedy tokens are the HF engine's, so it samples what the other engines sample.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from helpers.engines import megatron_engine, megatron_world, reference_logprobs
from test_engine_hf import EOS, PAD, PROMPTS, make_engine, tiny_llama

from megarl.engines.base import LoraAdapter, SamplingParams

# measured on this machine: at most 4.8e-7 over the cases below (fp32)
LOGPROB_ATOL = 5e-6


@pytest.fixture(scope="module", autouse=True)
def _world():
    with megatron_world():
        yield


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_logprobs_match_unpadded_full_forward(tie, temperature, top_p):
    model = tiny_llama(tie=tie)
    engine = megatron_engine(model, EOS, PAD)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10, seed=4)
    for generation in engine.generate(PROMPTS * 2, params):
        expected = reference_logprobs(model, generation, temperature)
        got = torch.tensor(generation.response_logprobs)
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_greedy_tokens_are_the_hf_engines(tie):
    model = tiny_llama(tie=tie)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    megatron = megatron_engine(model, EOS, PAD).generate(PROMPTS * 2, params)
    hf = make_engine(model).generate(PROMPTS * 2, params)
    assert [g.response_ids for g in megatron] == [g.response_ids for g in hf]
    for a, b in zip(megatron, hf, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
        )


def test_it_generates_with_the_bound_parameters_themselves_and_restores_their_modes():
    """No copy: a change to the bound model's parameters shows in the next generation, which
    scores like the HF model with the same change; the model comes back in the mode it was in
    (training, here)."""
    model = tiny_llama()
    engine = megatron_engine(model, EOS, PAD)
    assert engine._chunks is not None
    gpt = engine._chunks[0]
    gpt.train()
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    assert all(module.training for module in gpt.modules())
    with torch.no_grad():
        gpt.output_layer.weight.mul_(-1.0)
        model.lm_head.weight.mul_(-1.0)
    after = engine.generate(PROMPTS, params)
    assert [g.response_ids for g in after] != [g.response_ids for g in before]
    for generation in after:
        expected = reference_logprobs(model, generation)
        got = torch.tensor(generation.response_logprobs)
        torch.testing.assert_close(got, expected, atol=LOGPROB_ATOL, rtol=0)


def test_there_are_no_weights_to_send_or_free():
    engine = megatron_engine(tiny_llama(), EOS, PAD)
    with pytest.raises(RuntimeError, match="the engine is the actor's model"):
        engine.update_weights([])
    with pytest.raises(RuntimeError, match="the engine is the actor's model"):
        engine.load_lora_adapter(LoraAdapter({}, rank=2, alpha=4.0, target_modules=("q_proj",)))
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    expected = engine.generate(PROMPTS, params)
    engine.sleep(2)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    state = engine.wake_up()
    assert state.base_weights_resident and not state.adapter_resident
    assert engine.generate(PROMPTS, params) == expected


def test_a_worker_thread_generates_what_the_main_thread_does():
    """The agent loops call the engine from a worker thread, where the CPU shims' torch-function
    modes (thread-local) are off until the engine enters them."""
    import concurrent.futures

    engine = megatron_engine(tiny_llama(), EOS, PAD)
    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_thread = pool.submit(engine.generate, PROMPTS, params).result()
    assert in_thread == engine.generate(PROMPTS, params)

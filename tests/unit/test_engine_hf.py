"""HFEngine on a tiny random Llama: sampling, logprob definition, weights, memory, LoRA.

The central check is ``test_logprobs_match_unpadded_full_forward``: the engine's logprobs
(left-padded batch + KV cache) must equal a plain one-sequence forward of prompt+response.
That is what the trainer recomputes, so it proves padding, positions and cache are right.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")
from helpers.engines import random_lora, reference_logprobs
from helpers.models import MOE_EXPERTS, engine_llama
from transformers import LlamaForCausalLM

from megarl.engines.base import Generation, LoraAdapter, SamplingParams
from megarl.engines.hf import HFEngine, parse_peft_lora_name
from megarl.engines.sampling import invert_cdf, top_p_filter

VOCAB = 128
EOS = 2
PAD = 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
# peft reads a transformers property that is deprecated in transformers 5
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def tiny_llama(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    return engine_llama(seed, VOCAB, hidden_size=64, tie_word_embeddings=tie, pad_token_id=PAD)


def make_engine(model: LlamaForCausalLM, device: str = "cpu") -> HFEngine:
    return HFEngine(model, device=device, eos_token_ids=[EOS], pad_token_id=PAD)


def bias_eos(model: LlamaForCausalLM, bias: float) -> None:
    """Add ``bias`` to the EOS logit (a forward hook on lm_head)."""
    bias_V = torch.zeros(VOCAB)
    bias_V[EOS] = bias
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias_V.to(out.device))


def greedy(max_new_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)


def assert_same_samples(got: list[Generation], expected: list[Generation]) -> None:
    """Same tokens, logprobs equal up to GEMM rounding.

    Exact equality holds for repeated calls on the same weights; weights in new storage (a
    reload, another model object) may take a different CPU GEMM path and differ in the last
    bits, so comparisons across storage use this instead.
    """
    assert [g.response_ids for g in got] == [g.response_ids for g in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
        )


# --- shapes and stopping ----------------------------------------------------------------------


def test_generate_returns_one_generation_per_prompt_in_order():
    engine = make_engine(tiny_llama())
    generations = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=1))
    assert [g.prompt_ids for g in generations] == [tuple(p) for p in PROMPTS]
    for generation in generations:
        assert 1 <= len(generation.response_ids) <= 6
        assert len(generation.response_logprobs) == len(generation.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in generation.response_logprobs)
        assert all(0 <= t < VOCAB for t in generation.response_ids)
    assert engine.generate([], SamplingParams()) == []


def test_always_eos_stops_every_row_after_one_token():
    model = tiny_llama()
    bias_eos(model, 1e4)
    generations = make_engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert all(g.response_ids == (EOS,) and g.finished for g in generations)


def test_rows_stop_independently_at_eos():
    model = tiny_llama()
    bias_eos(model, 5.0)  # EOS likely but not certain: rows finish at different steps
    prompts = [[7, 8, 9]] * 16
    generations = make_engine(model).generate(prompts, SamplingParams(max_new_tokens=10, seed=3))
    for g in generations:
        assert EOS not in g.response_ids[:-1]
        if g.finished:
            assert g.response_ids[-1] == EOS
        else:
            assert len(g.response_ids) == 10
    assert len({len(g.response_ids) for g in generations}) > 1
    assert any(g.finished for g in generations)


def test_max_new_tokens_caps_unfinished_rows():
    model = tiny_llama()
    bias_eos(model, -1e4)
    generations = make_engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=5))
    assert all(len(g.response_ids) == 5 and not g.finished for g in generations)


def test_bad_prompts_are_rejected():
    engine = make_engine(tiny_llama())
    with pytest.raises(ValueError, match="request 1 has an empty prompt"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, VOCAB]], SamplingParams())


# --- the logprob definition -------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_logprobs_match_unpadded_full_forward(tie, temperature, top_p):
    model = tiny_llama(tie=tie)
    bias_eos(model, 2.0)  # some rows finish early and keep being fed pad tokens
    engine = make_engine(model)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, seed=5)
    for generation in engine.generate(PROMPTS, params):
        expected = reference_logprobs(model, generation, temperature)
        got = torch.tensor(generation.response_logprobs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_batched_greedy_equals_one_prompt_at_a_time():
    engine = make_engine(tiny_llama())
    batched = engine.generate(PROMPTS, greedy(10))
    alone = [engine.generate([p], greedy(10))[0] for p in PROMPTS]
    assert [g.response_ids for g in batched] == [g.response_ids for g in alone]


def test_tiny_top_p_is_greedy():
    engine = make_engine(tiny_llama())
    nucleus = engine.generate(PROMPTS, SamplingParams(top_p=1e-6, max_new_tokens=10, seed=9))
    argmax = engine.generate(PROMPTS, greedy(10))
    assert [g.response_ids for g in nucleus] == [g.response_ids for g in argmax]
    for a, b in zip(nucleus, argmax, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-6, rtol=0
        )


def test_top_p_filter_keeps_smallest_nucleus():
    probs_BV = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert (top_p_filter(probs_BV, 0.5) > 0).tolist() == [[True, False, False, False]]
    assert (top_p_filter(probs_BV, 0.75) > 0).tolist() == [[True, True, False, False]]
    assert (top_p_filter(probs_BV, 0.9) > 0).tolist() == [[True, True, True, False]]
    assert top_p_filter(probs_BV, 1.0) is probs_BV


def test_invert_cdf_draws_each_token_with_its_mass_and_never_a_zero():
    """Evenly spaced uniforms hit each token in proportion to its (unnormalised) mass; the
    extreme uniforms land on the first and last tokens that have mass, never on a zero."""
    probs_V = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0]) * 0.9  # top-p leaves no unit sum
    num_draws = 1000
    uniform_N = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws
    tokens_N = invert_cdf(probs_V.expand(num_draws, -1), uniform_N)
    counts = torch.bincount(tokens_N, minlength=len(probs_V)).tolist()
    assert counts == [0, 500, 0, 300, 200, 0]
    extremes = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert invert_cdf(probs_V.expand(2, -1), extremes).tolist() == [1, 4]
    # each row reads its own uniform
    rows = torch.stack([probs_V, probs_V.flip(0)])
    assert invert_cdf(rows, torch.tensor([0.99, 0.99], dtype=torch.float64)).tolist() == [4, 4]
    assert invert_cdf(rows, torch.tensor([0.99, 0.0], dtype=torch.float64)).tolist() == [4, 1]


# --- RNG --------------------------------------------------------------------------------------


def test_same_seed_same_generations_regardless_of_global_rng():
    engine = make_engine(tiny_llama())
    params = SamplingParams(max_new_tokens=12, seed=42)
    first = engine.generate(PROMPTS, params)
    torch.manual_seed(1234)
    torch.rand(1000)
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=7))
    assert engine.generate(PROMPTS, params) == first


def test_generate_does_not_touch_the_global_rng():
    engine = make_engine(tiny_llama())
    state = torch.get_rng_state()
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, seed=1))
    assert torch.equal(torch.get_rng_state(), state)


def test_different_seeds_and_repeated_prompts_give_different_samples():
    engine = make_engine(tiny_llama())
    group = [[7, 8, 9]] * 8
    responses = [g.response_ids for g in engine.generate(group, SamplingParams(seed=1))]
    assert len(set(responses)) > 1
    other = [g.response_ids for g in engine.generate(group, SamplingParams(seed=2))]
    assert other != responses


# --- weights ----------------------------------------------------------------------------------


def test_update_weights_makes_engine_match_the_new_model():
    engine = make_engine(tiny_llama(seed=0))
    new_model = tiny_llama(seed=1)
    before = engine.generate(PROMPTS, greedy(10))
    num_applied = engine.update_weights(new_model.state_dict().items())
    assert num_applied == len(new_model.state_dict())
    after = engine.generate(PROMPTS, greedy(10))
    expected = make_engine(tiny_llama(seed=1)).generate(PROMPTS, greedy(10))
    assert_same_samples(after, expected)
    assert [g.response_ids for g in after] != [g.response_ids for g in before]


def test_update_weights_rejects_unknown_names_and_bad_shapes():
    engine = make_engine(tiny_llama())
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(65))])


@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_moe_engine_takes_every_exported_name(family, tmp_path):
    """The exporter's names (the checkpoint's, one tensor per expert, Qwen2-MoE's shared expert
    and gate included) reach transformers 5's fused in-memory experts: the engine then holds
    exactly what was sent and computes the sender's logits."""
    from megarl.export.checksum import tensor_checksum
    from megarl.models import mapping
    from megarl.models.hf_io import load_hf_state_dict
    from megarl.models.random_init import build_random_hf_model
    from megarl.models.spec import spec_from_hf_config

    cfg = tiny_moe_config(family)
    engine = make_engine(build_random_hf_model(cfg, seed=0))
    new_model = build_random_hf_model(cfg, seed=1)
    new_model.save_pretrained(tmp_path)
    sent = load_hf_state_dict(tmp_path)
    assert sorted(sent) == sorted(mapping.expected_hf_names(spec_from_hf_config(new_model.config)))
    assert engine.update_weights(sent.items()) == len(sent)
    held = engine.weight_checksums(torch.float32)
    assert held == {name: tensor_checksum(t) for name, t in sent.items()}
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            engine.model(ids).logits, new_model(ids).logits, atol=1e-6, rtol=0
        )


def tiny_moe_config(family: str) -> dict:
    """A 2-layer model of ``family`` with :data:`MOE_EXPERTS`' experts."""
    return dict(
        model_type=family,
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        **MOE_EXPERTS[family],
    )


def tiny_moe(family: str, seed: int = 0) -> torch.nn.Module:
    from megarl.models.random_init import build_random_hf_model

    return build_random_hf_model(tiny_moe_config(family), seed=seed)


@torch.no_grad()
def reference_routing(model: torch.nn.Module, generation: Generation) -> torch.Tensor:
    """``[R, layers, k]`` experts of one unpadded, uncached forward of prompt+response at the
    positions that score the response (``P - 1 .. S - 2``), what the trainer compares."""
    return reference_input_routing(model, generation)[len(generation.prompt_ids) - 1 :]


@torch.no_grad()
def reference_input_routing(model: torch.nn.Module, generation: Generation) -> torch.Tensor:
    """``[S - 1, layers, k]`` experts of one plain forward at every input position but the
    last."""
    from megarl.engines.hf import find_hf_routers

    seen: list[torch.Tensor] = []
    routers = find_hf_routers(model)
    handles = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for r in routers]
    model(torch.tensor([generation.prompt_ids + generation.response_ids]))
    for handle in handles:
        handle.remove()
    return torch.stack(seen, dim=1)[:-1]


@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_moe_routing_is_that_of_each_tokens_scoring_forward(family):
    """The engine's expert ids (left-padded prefill, then cached decode columns) equal a plain
    full forward's at the positions that score each response token, as compact ids; a model
    whose first router moved (what a stale or wrong weight sync would leave) routes otherwise,
    and the comparison sees it."""
    from megarl.algo.routing_mismatch import routing_mismatch_of_sequences

    model = tiny_moe(family)
    perturbed = copy.deepcopy(model)
    bias_eos(model, 3.0)  # rows end at different steps: the batch shrinks as they do
    # repeated prompts share one prefill, then route apart as their samples differ
    prompts = PROMPTS + PROMPTS[:2]
    gens = make_engine(model).generate(prompts, SamplingParams(max_new_tokens=6, seed=2))
    assert len({len(g.response_ids) for g in gens}) > 1
    engine = {i: g.routed_experts for i, g in enumerate(gens) if g.routed_experts is not None}
    assert len(engine) == len(prompts)
    for i, g in enumerate(gens):
        assert engine[i].shape == (len(g.response_ids), 2, 2) and engine[i].dtype == torch.uint8
    same = routing_mismatch_of_sequences(
        {i: reference_routing(model, g) for i, g in enumerate(gens)}, engine
    )
    assert same.pairs == 2 * sum(len(g.response_ids) for g in gens)
    assert same.mismatched_pairs == 0
    # R3's input routing: the prefill's prompt positions (left padding cut off) and the
    # response rows, against the same full forward's positions 0 .. S - 2, as sets
    for g in gens:
        assert g.prompt_routed_experts is not None and g.routed_experts is not None
        assert g.prompt_routed_experts.shape == (len(g.prompt_ids) - 1, 2, 2)
        full = torch.cat([g.prompt_routed_experts, g.routed_experts]).long().sort(-1).values
        assert torch.equal(full, reference_input_routing(model, g).sort(-1).values)

    with torch.no_grad():
        router = perturbed.model.layers[0].mlp.gate.weight
        router.add_(torch.randn(router.shape, generator=torch.Generator().manual_seed(0)))
    moved = routing_mismatch_of_sequences(
        {i: reference_routing(perturbed, g) for i, g in enumerate(gens)}, engine
    )
    assert moved.pairs == same.pairs
    assert moved.mismatched_pairs > 0


def test_dense_models_report_no_routing():
    generations = make_engine(tiny_llama()).generate(PROMPTS, greedy(4))
    assert all(g.routed_experts is None for g in generations)


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_embedding_update_under_either_name(name):
    engine = make_engine(tiny_llama(tie=True))
    new_embedding = torch.randn(VOCAB, 64)
    assert engine.update_weights([(name, new_embedding)]) == 1
    model = engine.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, new_embedding)
    reference = tiny_llama(tie=True)
    reference.model.embed_tokens.weight.data.copy_(new_embedding)
    for generation in engine.generate(PROMPTS, greedy(6)):
        torch.testing.assert_close(
            torch.tensor(generation.response_logprobs),
            reference_logprobs(reference, generation, 0.0),
            atol=1e-5,
            rtol=0,
        )


# --- sleep / wake -----------------------------------------------------------------------------


def test_sleep_level_1_keeps_weights():
    engine = make_engine(tiny_llama())
    before = engine.generate(PROMPTS, greedy())
    engine.sleep(1)
    assert engine.memory_state().base_weights_resident
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, greedy())
    state = engine.wake_up()
    assert state.base_weights_resident and not state.adapter_resident
    assert_same_samples(engine.generate(PROMPTS, greedy()), before)


def test_sleep_level_2_frees_weights_until_all_are_resent():
    model = tiny_llama(tie=True)
    full_state = {name: t.clone() for name, t in model.state_dict().items()}
    engine = make_engine(model)
    before = engine.generate(PROMPTS, greedy())

    engine.sleep(2)
    assert not engine.memory_state().base_weights_resident
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="asleep"):
        engine.update_weights(full_state.items())

    assert not engine.wake_up().base_weights_resident
    with pytest.raises(RuntimeError, match="freed"):
        engine.generate(PROMPTS, greedy())
    engine.update_weights([("model.norm.weight", full_state["model.norm.weight"])])
    assert not engine.memory_state().base_weights_resident

    without_lm_head = [(n, t) for n, t in full_state.items() if n != "lm_head.weight"]
    engine.update_weights(without_lm_head)  # tied: the embedding covers lm_head
    assert engine.memory_state().base_weights_resident
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert_same_samples(engine.generate(PROMPTS, greedy()), before)


def test_sleep_levels_are_validated():
    engine = make_engine(tiny_llama())
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(3)
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep(2)
    engine.wake_up()
    assert engine.wake_up().base_weights_resident  # waking an awake engine is a no-op


# --- LoRA -------------------------------------------------------------------------------------


def peft_adapter(base: LlamaForCausalLM, seed: int, targets: list[str]):
    """A random PEFT LoRA on a copy of ``base``, times 3 (an effect large enough to see):
    (PEFT state dict, merged HF model)."""
    return random_lora(base, seed, targets, rank=4, alpha=8, scale=3.0)


def assert_engine_matches(engine: HFEngine, reference: torch.nn.Module) -> None:
    ids_BT = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            engine.model(ids_BT).logits, reference(ids_BT).logits, atol=1e-5, rtol=1e-5
        )
    params = SamplingParams(temperature=0.9, max_new_tokens=8, seed=4)
    for generation in engine.generate(PROMPTS, params):
        torch.testing.assert_close(
            torch.tensor(generation.response_logprobs),
            reference_logprobs(reference, generation, 0.9),
            atol=1e-5,
            rtol=0,
        )


@pytest.mark.parametrize("tie", [False, True])
def test_lora_adapter_equals_merged_weights_and_replaces_previous(tie):
    base = tiny_llama(tie=tie)
    first, merged_first = peft_adapter(base, seed=1, targets=["q_proj", "v_proj"])
    second, merged_second = peft_adapter(base, seed=2, targets=["o_proj", "down_proj"])
    assert next(iter(first)).startswith("base_model.model.model.layers.0.")
    engine = make_engine(copy.deepcopy(base))

    engine.load_lora_adapter(
        LoraAdapter(first, rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    )
    assert engine.memory_state().adapter_resident
    assert_engine_matches(engine, merged_first)

    engine.load_lora_adapter(
        LoraAdapter(second, rank=4, alpha=8, target_modules=("o_proj", "down_proj"))
    )
    assert_engine_matches(engine, merged_second)
    assert not any("q_proj.lora" in name for name, _ in engine.model.named_parameters())

    engine.unload_lora_adapter()
    assert_engine_matches(engine, base)


def test_bad_adapter_is_rejected_and_leaves_base_model():
    base = tiny_llama()
    adapter, _ = peft_adapter(base, seed=1, targets=["q_proj"])
    engine = make_engine(copy.deepcopy(base))
    incomplete = {n: t for n, t in adapter.items() if "layers.1." not in n}
    with pytest.raises(ValueError, match="missing"):
        engine.load_lora_adapter(
            LoraAdapter(incomplete, rank=4, alpha=8, target_modules=("q_proj",))
        )
    wrong_target = {n.replace("q_proj", "k_proj"): t for n, t in adapter.items()}
    with pytest.raises(ValueError, match="k_proj"):
        engine.load_lora_adapter(
            LoraAdapter(wrong_target, rank=4, alpha=8, target_modules=("q_proj",))
        )
    assert not engine.memory_state().adapter_resident
    assert_engine_matches(engine, base)


def test_weight_update_keeps_adapter_and_sleep_2_drops_it():
    base = tiny_llama()
    adapter, _ = peft_adapter(base, seed=1, targets=["q_proj", "v_proj"])
    new_base = tiny_llama(seed=3)
    _, merged_on_new_base = peft_adapter(new_base, seed=1, targets=["q_proj", "v_proj"])
    engine = make_engine(copy.deepcopy(base))
    engine.load_lora_adapter(
        LoraAdapter(adapter, rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    )

    engine.update_weights(new_base.state_dict().items())  # HF names, though layers are wrapped
    assert_engine_matches(engine, merged_on_new_base)

    engine.sleep(2)
    state = engine.wake_up()
    assert not state.adapter_resident and not state.base_weights_resident


def test_parse_peft_lora_name():
    expected = ("model.layers.0.self_attn.q_proj", "lora_A")
    assert (
        parse_peft_lora_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
        == expected
    )
    assert parse_peft_lora_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") == expected
    with pytest.raises(ValueError, match="lora_A/lora_B"):
        parse_peft_lora_name("model.layers.0.self_attn.q_proj.weight")


# --- accelerator and real model ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logprobs_match_and_sleep_offloads():
    model = tiny_llama()
    engine = make_engine(model, device="cuda")
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=2)
    generations = engine.generate(PROMPTS, params)
    for generation in generations:
        torch.testing.assert_close(
            torch.tensor(generation.response_logprobs),
            reference_logprobs(model, generation, 0.8),
            atol=1e-4,
            rtol=0,
        )
    engine.sleep(1)
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.wake_up()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert_same_samples(engine.generate(PROMPTS, params), generations)


@pytest.mark.slow
def test_smollm2_answers_arithmetic_in_chat_format():
    hf_io = pytest.importorskip("megarl.models.hf_io")
    model, tokenizer = hf_io.load_hf_model(None)
    engine = HFEngine(model, tokenizer)
    messages = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    generations = engine.generate([list(prompt)] * 4, SamplingParams(max_new_tokens=16, seed=0))
    for generation in generations:
        text = tokenizer.decode(generation.response_ids, skip_special_tokens=True)
        assert text.strip()
        assert all(math.isfinite(lp) for lp in generation.response_logprobs)


def test_corrupt_engine_fault_scales_the_final_norm_at_its_phase_and_step_only(monkeypatch):
    """``MEGARL_FAULT_AT=0:2:rollout:corrupt-engine`` scales exactly one tensor of the
    registered engine, by ``CORRUPT_FACTOR``, the first time rank 0 enters step 2's rollout, and
    the engine's logprobs leave those of the weights it was given."""
    from megarl.distributed import fault_injection

    model = tiny_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = make_engine(model)
    [clean] = engine.generate([[1, 5, 9, 11]], greedy(4))
    monkeypatch.setenv(fault_injection.AT_ENV, "0:2:rollout:corrupt-engine")
    monkeypatch.setattr(fault_injection, "_fired_at", False)
    monkeypatch.setattr(fault_injection, "_engine", None)
    fault_injection.register_engine(engine)
    fault_injection.at_phase(0, 1, "rollout")  # another step: nothing
    fault_injection.at_phase(0, 2, "scatter")  # another phase: nothing
    fault_injection.at_phase(1, 2, "rollout")  # another rank: nothing
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    fault_injection.at_phase(0, 2, "rollout")
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == [fault_injection.CORRUPT_TENSOR]
    scaled = before[fault_injection.CORRUPT_TENSOR] * fault_injection.CORRUPT_FACTOR
    assert torch.equal(model.get_parameter(fault_injection.CORRUPT_TENSOR), scaled)
    [again] = engine.generate([[1, 5, 9, 11]], greedy(4))
    assert again.response_ids[0] == clean.response_ids[0]  # greedy: the argmax survives a scale
    assert abs(again.response_logprobs[0] - clean.response_logprobs[0]) > 1e-3

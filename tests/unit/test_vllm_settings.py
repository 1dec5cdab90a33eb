"""The vLLM start-up decision on plain values: every branch, no vLLM needed."""

from __future__ import annotations

import pytest

from megarl.engines.vllm_settings import (
    CPU_KV_BLOCK_TOKENS,
    GIB,
    IN_ENGINE_CORE_EXECUTOR,
    PLAIN_WEIGHTS_CPU_WORKER,
    ModelFacts,
    VLLMRequest,
    VLLMSettingsError,
    cpu_engine_defaults,
    cpu_kv_cache_bytes,
    decide_vllm_settings,
    kv_bytes_per_token,
    logprobs_mode,
    vllm_max_lora_rank,
)

MODEL = ModelFacts(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
CPU = VLLMRequest(device="cpu", params_dtype="float32")
GPU = VLLMRequest(device="cuda", params_dtype="bfloat16")


def decide(request: VLLMRequest, model: ModelFacts = MODEL, available: int = 16 * GIB):
    return decide_vllm_settings(request, model, "/m", available)


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(MODEL, "float32") == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(MODEL, "bfloat16") == 2 * 30 * 3 * 64 * 2


def test_cpu_kv_cache_is_a_tenth_of_free_memory_within_bounds():
    per_seq = 8192 * kv_bytes_per_token(MODEL, "float32")
    assert cpu_kv_cache_bytes(CPU, MODEL, 16 * GIB) == int(1.6 * GIB)
    assert cpu_kv_cache_bytes(CPU, MODEL, 200 * GIB) == 4 * GIB  # capped
    assert cpu_kv_cache_bytes(CPU, MODEL, 2 * GIB) == per_seq  # at least one full sequence


def test_cpu_kv_cache_refuses_what_cannot_fit_naming_the_key():
    with pytest.raises(VLLMSettingsError, match="rollout.max_model_len=8192"):
        cpu_kv_cache_bytes(CPU, MODEL, 500 << 20)
    with pytest.raises(VLLMSettingsError, match="rollout.kv_cache_gb=32"):
        cpu_kv_cache_bytes(VLLMRequest("cpu", "float32", kv_cache_gb=32), MODEL, 16 * GIB)
    with pytest.raises(VLLMSettingsError, match="one sequence of max_model_len=8192"):
        cpu_kv_cache_bytes(VLLMRequest("cpu", "float32", kv_cache_gb=0.1), MODEL, 16 * GIB)
    short = VLLMRequest("cpu", "float32", kv_cache_gb=0.1, max_model_len=512)
    assert cpu_kv_cache_bytes(short, MODEL, 16 * GIB) == int(0.1 * GIB)


def test_logprob_mode_reports_the_untruncated_distribution_or_refuses():
    assert logprobs_mode(1.0, 0.9) == "raw_logprobs"  # T = 1: raw is exact whatever top-p
    assert logprobs_mode(0.0, 1.0) == "raw_logprobs"  # greedy reports temperature 1
    assert logprobs_mode(0.7, 1.0) == "processed_logprobs"
    with pytest.raises(VLLMSettingsError, match="rollout.top_p=0.9 with rollout.temperature=0.7"):
        logprobs_mode(0.7, 0.9)


def test_cpu_defaults_eager_explicit_kv_and_no_sleep():
    settings = decide(VLLMRequest("cpu", "float32", sleep_level=2))
    kwargs = settings.engine_kwargs
    assert kwargs["enforce_eager"] is True and kwargs["enable_sleep_mode"] is False
    assert kwargs["kv_cache_memory_bytes"] == int(1.6 * GIB)
    assert settings.sleep_level == 0
    assert settings.notes == (
        (
            "rollout.sleep_level=2 runs as 0: vLLM's CPU build has no sleep "
            "mode (the engine stays resident)"
        ),
    )


def test_gpu_keeps_graphs_sleep_and_vllm_memory_sizing():
    settings = decide(VLLMRequest("cuda", "bfloat16", sleep_level=2))
    kwargs = settings.engine_kwargs
    assert kwargs["enforce_eager"] is False and kwargs["enable_sleep_mode"] is True
    assert "kv_cache_memory_bytes" not in kwargs and settings.sleep_level == 2
    assert settings.notes == ()
    assert (
        decide(VLLMRequest("cuda", "bfloat16", enforce_eager=True)).engine_kwargs["enforce_eager"]
        is True
    )


def test_a_sync_copies_in_place_on_cpu_and_reloads_on_cuda():
    assert decide(CPU).engine_kwargs["weight_load_method"] == "load_weights"
    assert decide(VLLMRequest("cpu", "bfloat16")).engine_kwargs["weight_load_method"] == (
        "load_weights"
    )
    assert decide(GPU).engine_kwargs["weight_load_method"] == "reload"


def test_a_cpu_engine_keeps_plain_weights_for_in_place_loads_and_runs_one_rank_in_its_core():
    blocks = {"block_size": CPU_KV_BLOCK_TOKENS}
    assert cpu_engine_defaults("load_weights", tp=1) == blocks | {
        "worker_cls": PLAIN_WEIGHTS_CPU_WORKER,
        "distributed_executor_backend": IN_ENGINE_CORE_EXECUTOR,
    }
    assert cpu_engine_defaults("reload", tp=1) == blocks | {
        "distributed_executor_backend": IN_ENGINE_CORE_EXECUTOR
    }
    # several ranks keep vLLM's worker processes (one per rank, each bound to its cores)
    assert cpu_engine_defaults("load_weights", tp=2) == blocks | {
        "worker_cls": PLAIN_WEIGHTS_CPU_WORKER
    }
    assert cpu_engine_defaults("reload", tp=2) == blocks
    # vLLM's CPU attention takes multiples of 32; smaller blocks share more of a prompt
    assert CPU_KV_BLOCK_TOKENS % 32 == 0 and CPU_KV_BLOCK_TOKENS < 128


def test_cpu_attention_head_size_is_checked():
    with pytest.raises(VLLMSettingsError, match="head size 16 is not supported"):
        decide(CPU, ModelFacts(4, 4, 16, 512))
    decide(GPU, ModelFacts(4, 4, 16, 512))  # CUDA attention takes it


def test_mixture_of_experts_is_refused_on_cpu_only():
    moe = ModelFacts(4, 4, 64, 512, num_experts=8)
    with pytest.raises(VLLMSettingsError, match="mixture-of-experts.*rollout.engine=hf"):
        decide(CPU, moe)
    decide(GPU, moe)


def test_max_model_len_beyond_the_model_is_refused():
    with pytest.raises(VLLMSettingsError, match="rollout.max_model_len=9000"):
        decide(VLLMRequest("cpu", "float32", max_model_len=9000))


def test_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    kwargs = decide(VLLMRequest("cpu", "float32", lora_rank=4)).engine_kwargs
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 8
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 17, 300)] == [1, 8, 8, 16, 32, 320]
    with pytest.raises(VLLMSettingsError, match="actor.lora.rank=600"):
        vllm_max_lora_rank(600)


def test_vllm_missing_is_one_line_before_any_model_is_loaded(vllm_not_installed):
    from megarl.config.schema import build_run_config
    from megarl.train import StartupError, check_vllm

    cfg = build_run_config({"rollout": {"engine": "vllm"}})
    with pytest.raises(StartupError, match="needs vLLM, which is not installed") as error:
        check_vllm(cfg, "/no/model/is/read", "cpu")
    assert "\n" not in str(error.value) and "rollout.engine=hf" in str(error.value)

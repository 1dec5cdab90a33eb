"""rollout.* keys reach the vLLM settings decision."""

from __future__ import annotations

from megarl.config.schema import build_run_config
from megarl.engines.vllm_settings import ModelFacts, decide_vllm_settings
from megarl.trainer.engine_setup import vllm_request

SMOLLM2 = ModelFacts(num_layers=30, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_rollout_keys_reach_the_engine_arguments():
    cfg = build_run_config(
        {
            "rollout": {
                "engine": "vllm",
                "tp": 2,
                "sleep_level": 2,
                "gpu_memory_utilization": 0.35,
                "max_num_seqs": 64,
                "max_num_batched_tokens": 4096,
                "kv_cache_gb": 2.0,
                "max_model_len": 1024,
                "enforce_eager": False,
            },
            "export": {"bucket_mb": 64},
            "trainer": {"seed": 7},
        }
    )
    request = vllm_request(cfg, "cuda", "bfloat16")
    kwargs = decide_vllm_settings(request, SMOLLM2, "/models/x", 64 << 30).engine_kwargs
    assert kwargs == {
        "model": "/models/x",
        "dtype": "bfloat16",
        "seed": 7,
        "tensor_parallel_size": 2,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "max_model_len": 1024,
        "enforce_eager": False,
        "enable_sleep_mode": True,
        "logprobs_mode": "raw_logprobs",
        "weight_bucket_bytes": 64 << 20,
        "gpu_memory_utilization": 0.35,
        "enable_prefix_caching": True,
        "weight_load_method": "reload",
        "kv_cache_memory_bytes": 2 << 30,
    }


def test_engine_dtype_follows_the_trainer_on_cpu():
    cfg = build_run_config({"rollout": {"engine": "vllm"}})
    settings = decide_vllm_settings(vllm_request(cfg, "cpu", "float32"), SMOLLM2, "m", 16 << 30)
    assert settings.engine_kwargs["dtype"] == "float32"
    assert settings.engine_kwargs["enforce_eager"] is True

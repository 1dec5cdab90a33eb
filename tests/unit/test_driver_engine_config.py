"""rollout.* keys reach the vLLM engine."""

from __future__ import annotations

from megarl.config.schema import build_run_config
from megarl.trainer.driver import vllm_engine_kwargs


def test_vllm_kwargs_come_from_rollout_keys():
    cfg = build_run_config({"rollout": {"engine": "vllm", "tp": 2, "sleep_level": 2,
                                        "gpu_memory_utilization": 0.35, "max_num_seqs": 64,
                                        "max_num_batched_tokens": 4096},
                            "export": {"bucket_mb": 64}, "trainer": {"seed": 7}})
    kwargs = vllm_engine_kwargs(cfg, "/models/x")
    assert kwargs == {"model": "/models/x", "seed": 7, "tensor_parallel_size": 2,
                      "gpu_memory_utilization": 0.35, "max_num_seqs": 64,
                      "max_num_batched_tokens": 4096, "enable_sleep_mode": True,
                      "dtype": "bfloat16", "weight_bucket_bytes": 64 * 1024**2}
    plain = vllm_engine_kwargs(build_run_config({"model": {"dtype": "float32"}}), "m")
    assert plain["enable_sleep_mode"] is False and plain["dtype"] == "float32"

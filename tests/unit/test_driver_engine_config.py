"""rollout.* keys reach the vLLM engine; sleep levels drive sleep/wake and the survival report."""

from __future__ import annotations

from types import SimpleNamespace

from megarl.config.schema import build_run_config
from megarl.engines.base import EngineMemoryState
from megarl.trainer.driver import Driver, vllm_engine_kwargs


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


class FakeEngine:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.level = level

    def wake_up(self):
        self.calls.append(("wake",))
        return EngineMemoryState(base_weights_resident=self.level == 1, adapter_resident=False)

    def update_weights(self, items):
        self.calls.append(("update", len(list(items))))


def _driver(level: int) -> Driver:
    driver = Driver.__new__(Driver)  # only the sleep bookkeeping is exercised
    driver.cfg = build_run_config({"rollout": {"sleep_level": level}})
    driver.engine = FakeEngine()
    driver.producer = SimpleNamespace(produce=lambda step: ("batch", step))
    driver.last_wake_state = None
    return driver


def test_sleep_after_rollout_wake_before_weights_and_report():
    for level, survived in ((1, 1.0), (2, 0.0)):
        driver = _driver(level)
        assert driver.rollout(3) == ("batch", 3)
        driver.update_engine_weights({"w": object()})
        assert driver.engine.calls == [("sleep", level), ("wake",), ("update", 1)]
        assert driver.engine_memory_metrics() == {
            "rollout/sleep_level": float(level), "rollout/base_weights_survived_sleep": survived}


def test_no_sleep_at_level_zero():
    driver = _driver(0)
    driver.rollout(1)
    driver.update_engine_weights(None)
    assert driver.engine.calls == [] and driver.engine_memory_metrics() == {}

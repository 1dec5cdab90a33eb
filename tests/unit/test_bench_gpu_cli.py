"""benchmarks/bench_gpu.py imports anywhere and refuses cleanly without CUDA."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def test_bench_gpu_exits_2_with_one_line_without_cuda(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--models", "smollm2"])
    assert module.main() == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err
    overrides = module._overrides(
        type(
            "A",
            (),
            {
                "steps": 3,
                "engine": "hf",
                "n": 8,
                "prompts": 2,
                "max_new_tokens": 16,
                "micro_batch_tokens": 4096,
            },
        )(),
        module.MODELS["random-0.9b"][1],
        True,
        "/r",
    )
    from megarl.train import compose_config

    cfg = compose_config(overrides)  # every override is a real key
    assert cfg.model.hf_config["hidden_size"] == 2048 and cfg.actor.pack_sequences

"""Shared fixtures for integration tests (real Megatron ranks on CPU/gloo)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from forked_cli import ForkedTrain

TINY_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
"""The tiny Llama the export, LoRA and equivalence tests build with random weights."""


def tiny_llama_hf_config() -> dict:
    """``model=tiny_llama``'s HF config (configs/model/tiny_llama.yaml), what runs train."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny_llama.yaml"
    return dict(yaml.safe_load(path.read_text())["hf_config"])


def value_model_folder(folder, hf_config: dict, seed: int, num_labels: int = 1, bias: float = 0.0):
    """A random-init ``...ForTokenClassification`` (what verl's critic loads) of ``hf_config``,
    its ``score.bias`` set to ``bias``, saved by transformers: a ``critic.model.path``.
    Returns the model (eval mode)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.for_model(**hf_config, num_labels=num_labels)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.bias.fill_(bias)
    model.save_pretrained(folder, safe_serialization=True)
    return model


REQUIRED_METRICS = (
    "step",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "critic/rewards/mean",
    "critic/advantages/zero_adv_ratio",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "response_length/mean",
    "rollout/logprob_abs_diff",
    "rollout_corr/kl",
    "rollout_corr/rollout_is_mean",
    "perf/throughput",
)


def tiny_overrides(run_dir, steps: int = 2, **extra: object) -> list[str]:
    """A fast tiny-model run: 2 prompts x 4 samples, short responses, synthetic mixed rewards."""
    base = {
        "model": "tiny_llama",
        "trainer.total_steps": steps,
        "trainer.run_dir": str(run_dir),
        "trainer.log_console": "false",
        "trainer.tensorboard": "false",
        "rollout.n": 4,
        "data.prompts_per_step": 2,
        "rollout.max_new_tokens": 6,
        "data.reward": "synthetic_rewards:char_parity",
        "actor.lr": 1e-3,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_run(tmp_path):
    from megarl.train import run

    def _run(steps: int = 2, return_final_state: bool = False, **extra):
        return run(
            tiny_overrides(tmp_path / "run", steps, **extra), return_final_state=return_final_state
        )

    return _run


@pytest.fixture(scope="session")
def train_cli(tmp_path_factory):
    """``train_cli.run(*args, cwd=...)``: ``megarl-train`` in a forked child of a warm
    interpreter (see forked_cli.py), for tests that start many short runs."""
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    server = ForkedTrain({**os.environ, "PYTHONPATH": path}, tmp_path_factory.mktemp("forked"))
    yield server
    server.close()

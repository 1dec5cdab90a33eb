"""What the integration tests' training runs are given: tiny overrides, the metrics every step
logs, and a subprocess's environment."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INTEGRATION = REPO / "tests" / "integration"
"""Where runs find the test modules they name (``synthetic_rewards``, ``agent_loops``)."""


def run_env(**extra: str) -> dict[str, str]:
    """A ``megarl-train`` subprocess's environment: this one's, ``PYTHONPATH`` the repository,
    tests/integration and tests (whose ``helpers`` those modules import), and ``extra``."""
    paths = [str(REPO), str(INTEGRATION), str(REPO / "tests")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


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


def metrics_rows(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl``, a dict per line."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def one_ray():
    """One private Ray for the runs of a module that imports this fixture (the launcher leaves
    a Ray it did not start)."""
    import ray

    from megarl.distributed.ray_launcher import connect

    connect()
    yield
    ray.shutdown()

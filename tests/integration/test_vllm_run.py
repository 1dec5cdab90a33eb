"""Training runs with ``rollout.engine=vllm`` on vLLM's CPU build, colocated and split.

Every step the engine must serve exactly the trainer's weights: ``rollout/logprob_abs_diff``
(engine vs trainer logprobs of the sampled tokens, fp32) stays at float rounding, and with
``export.checksum_interval=1`` the engine's weights are checked bit for bit after every sync.
"""

from __future__ import annotations

import pytest
from helpers.runs import tiny_overrides

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from megarl.train import run  # noqa: E402

LP_DIFF_BOUND = 1e-4
SPLIT = {"rollout.engine": "vllm", "trainer.launcher": "ray", "rollout.n_gpus": 1}
"""vLLM in a rollout actor of its own (Ray), beside the training ranks."""


def test_colocated_at_actor_tp2_serves_the_trainers_weights_every_step(tmp_path):
    """Inside rank 0 of a 2-rank run: vLLM's own processes keep it off the trainer's group.

    The model is Qwen3 (the split run below is Llama): its per-head q/k norms and its head size
    apart from hidden / heads go through the exporter into vLLM's own Qwen3 model."""
    result = run(
        tiny_overrides(
            tmp_path / "run",
            steps=3,
            **{
                "model": "tiny_qwen3",
                "rollout.engine": "vllm",
                "actor.tp": 2,
                "trainer.n_gpus_per_node": 2,
                "export.checksum_interval": 1,
                "planner.prune_zero_adv": "off",
            },
        )
    )
    assert [row["step"] for row in result.history] == [1, 2, 3]
    for row in result.history:
        assert row["rollout/logprob_abs_diff"] <= LP_DIFF_BOUND, row["step"]
        assert row["export/checksum_ok"] == 1.0
        assert row["gates/base_weight_sync"] == 1.0
    assert result.history[-1]["actor/grad_norm"] > 0


def test_split_lora_syncs_only_the_adapter_and_sleep_runs_at_level_0(tmp_path, capsys):
    """The rollout actor hosts vLLM; LoRA with ``sleep_level=2``, which the CPU build cannot do:
    the run warns, sleeps at 0, and the engine's own report (base weights kept) lets the gate
    send only the adapter; step 2's logprobs show the adapter reached the engine."""
    result = run(
        tiny_overrides(
            tmp_path / "run",
            steps=2,
            **{
                **SPLIT,
                "actor.lora.rank": 8,
                "rollout.sleep_level": 2,
                "planner.prune_zero_adv": "off",
            },
        )
    )
    assert "rollout.sleep_level=2 runs as 0" in capsys.readouterr().err
    for row in result.history:
        assert row["rollout/logprob_abs_diff"] <= LP_DIFF_BOUND, row["step"]
        assert row["engine/sleep_level"] == 0.0
        assert row["engine/base_weights_resident"] == 1.0
        assert row["gates/base_weight_sync"] == 0.0
    assert result.history[-1]["actor/grad_norm"] > 0


def test_split_fully_async_with_partial_rollouts_serves_every_version_bit_for_bit(tmp_path):
    """The asynchronous rollout loop drives vLLM (interruptible generation, weights staged and
    applied between generations): the engine's weights are checked bit for bit after every
    sync, step 1 (sampled by the initial weights) matches the trainer's logprobs, and step 2
    trains tokens one version old, weighed by the rollout correction."""
    result = run(
        tiny_overrides(
            tmp_path / "run",
            steps=2,
            **{
                **SPLIT,
                "async_training.mode": "fully_async",
                "async_training.partial_rollout": True,
                "export.checksum_interval": 1,
                "rollout.max_new_tokens": 16,
            },
        )
    )
    first, second = result.history
    assert first["rollout/logprob_abs_diff"] <= LP_DIFF_BOUND
    assert [row["export/checksum_ok"] for row in result.history] == [1.0, 1.0]
    assert second["async/staleness/max"] == 1.0
    assert "proximal; behaviour version 0 < trainer 1" in second["gates/summary"]
    assert second["rollout_corr/kl"] > 0  # one step of training apart: the correction's work

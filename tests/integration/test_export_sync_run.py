"""The streamed weight sync inside a real run: metrics, checksum, an interleaved-pipeline run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.runs import tiny_overrides

from megarl.train import StartupError, run

pytestmark = pytest.mark.slow


def _tiny_llama_bytes() -> int:
    from omegaconf import OmegaConf

    from megarl.models.spec import spec_from_hf_config

    cfg = OmegaConf.load(Path(__file__).parents[2] / "configs/model/tiny_llama.yaml")
    return spec_from_hf_config(OmegaConf.to_container(cfg.hf_config)).num_parameters() * 4


def test_run_streams_buckets_and_checksums(tmp_path):
    result = run(
        tiny_overrides(
            tmp_path / "run", steps=2, **{"export.bucket_mb": 4, "export.checksum_interval": 2}
        )
    )
    first, second = result.history
    for row in result.history:
        assert row["rollout/logprob_abs_diff"] <= 1e-3, row
        # tiny_llama: two 25 MB vocabulary tensors (each alone) and ~1.6 MB of layers
        assert row["export/buckets"] == 3
        assert row["export/bytes"] == _tiny_llama_bytes()
        # one bucket plus the largest gathered tensor (the 25 MB embedding) at most
        assert 0 < row["export/peak_bytes"] <= 4 * 2**20 + 2 * 49152 * 128 * 4
    assert "export/checksum_ok" not in first
    assert second["export/checksum_ok"] == 1.0


def test_an_interleaved_pipeline_run_resumes_a_plain_pipelines_checkpoint_and_trains(
    tmp_path, capsys
):
    """A checkpoint of ``actor.pp=2`` resumes at ``actor.vpp=2`` (the layers regroup into two
    chunks per rank) and training goes on end to end: the planner runs micro-batches in pairs,
    each step trains, and the engine's logprobs after each streamed sync match the trainer's."""
    common = {
        "actor.pp": 2,
        "trainer.n_gpus_per_node": 2,
        "trainer.save_interval": 1,
        "planner.old_log_prob": "always",
    }
    run(tiny_overrides(tmp_path / "run", steps=1, **common, **{"actor.vpp": 1}))
    result = run(tiny_overrides(tmp_path / "run", steps=3, **common, **{"actor.vpp": 2}))
    assert "changed settings: actor.vpp: 1 -> 2" in capsys.readouterr().out
    assert [row["step"] for row in result.history] == [1, 2, 3]  # step 1: the resumed run's
    for row in result.history:
        assert row["actor/grad_norm"] > 0, row
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row
        if row["step"] > 1:  # interleaved: in pairs
            assert row["planner/num_micro_batches"] % 2 == 0, row


def test_an_interleaved_pipeline_with_lora_is_refused_at_start_up(tmp_path):
    vpp = {"actor.pp": 2, "actor.vpp": 2, "trainer.n_gpus_per_node": 2, "actor.lora.rank": 4}
    with pytest.raises(StartupError, match=r"actor.vpp > 1 .* LoRA"):
        run(tiny_overrides(tmp_path / "run", **vpp))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_checksum_with_a_tensor_parallel_vllm_is_refused_at_start_up(tmp_path):
    """vLLM checksums whole HF tensors; an engine split over rollout.tp ranks holds slices."""
    with pytest.raises(StartupError, match="export.checksum_interval=1 needs rollout.tp=1"):
        run(
            tiny_overrides(
                tmp_path / "run",
                **{"export.checksum_interval": 1, "rollout.engine": "vllm", "rollout.tp": 2},
            )
        )

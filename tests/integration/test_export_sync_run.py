"""The streamed weight sync inside a real run: metrics, checksum, and the VPP start-up refusal."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides

from megarl.train import StartupError, run

pytestmark = pytest.mark.slow


def test_run_streams_buckets_and_checksums(tmp_path):
    result = run(tiny_overrides(tmp_path / "run", steps=2, **{
        "export.bucket_mb": 4, "export.checksum_interval": 2}))
    first, second = result.history
    for row in result.history:
        assert row["rollout/logprob_abs_diff"] <= 1e-3, row
        assert row["export/buckets"] > 5  # tiny_llama is ~60 MB: many 4 MB buckets
        assert row["export/bytes"] > 50e6
        # one bucket plus the largest gathered tensor (the 25 MB embedding) at most
        assert 0 < row["export/peak_bytes"] <= 4 * 2**20 + 2 * 49152 * 128 * 4
    assert "export/checksum_ok" not in first
    assert second["export/checksum_ok"] == 1.0


def test_vpp_training_is_refused_at_start_up(tmp_path):
    with pytest.raises(StartupError, match="actor.vpp > 1"):
        run(tiny_overrides(tmp_path / "run", **{"actor.pp": 2, "actor.vpp": 2,
                                                "trainer.n_gpus_per_node": 2}))


def test_checksum_with_vllm_is_refused_at_start_up(tmp_path):
    with pytest.raises(StartupError, match="export.checksum_interval"):
        run(tiny_overrides(tmp_path / "run", **{"export.checksum_interval": 1,
                                                "rollout.engine": "vllm"}))

"""Mixture-of-experts training on CPU: experts split over expert-parallel ranks train like one
rank holding them all (and route alike: ``actor/moe_*``), and a checkpoint saved at one
expert-parallel size resumes at another.

Tiny random-init Qwen3-MoE and Qwen2-MoE (4 experts, top-2; Qwen2-MoE with a gated shared
expert, which every rank holds) with the HF engine, 2 ranks (DP=2).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_overrides
from safetensors import safe_open

from megarl.checkpoint.convert import write_hf_folder
from megarl.checkpoint.layout import read_checkpoint
from megarl.models.hf_io import load_hf_state_dict
from megarl.train import run

pytestmark = pytest.mark.slow

MOE = {"trainer.n_gpus_per_node": 2, "export.checksum_interval": 1}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_qwen2_moe"])
def test_ep2_trains_like_ep1_and_resumes_at_ep1(model, tmp_path):
    moe = dict(MOE, model=model)
    split_dir = tmp_path / "ep2"
    split = run(
        tiny_overrides(split_dir, 2, **moe, **{"actor.ep": 2, "trainer.save_interval": 2}),
        return_final_state=True,
    )
    whole = run(tiny_overrides(tmp_path / "ep1", 2, **moe), return_final_state=True)

    initial = load_hf_state_dict(split_dir / "init_model")
    assert any(".mlp.experts.3.down_proj." in name for name in initial)
    assert _max_diff(split.final_state, initial) > 1e-4, "training barely moved the weights"
    # the same training up to float rounding (experts computed on other ranks, sums reordered)
    assert _max_diff(split.final_state, whole.final_state) <= 1e-5
    for a, b in zip(split.history, whole.history, strict=True):
        assert a["critic/rewards/mean"] == b["critic/rewards/mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6)
        # the engine serves exactly the trainer's weights, gathered from both expert ranks
        assert a["export/checksum_ok"] == 1.0
        assert a["rollout/logprob_abs_diff"] <= 1e-4
        # the same tokens reach the same experts whichever rank holds them
        assert 1.0 <= a["actor/moe_load_imbalance"] <= 4 / 2  # at most experts / top_k
        assert a["actor/moe_load_imbalance"] == pytest.approx(b["actor/moe_load_imbalance"])
        assert a["actor/moe_aux_loss"] == pytest.approx(b["actor/moe_aux_loss"], rel=1e-6)

    saved = read_checkpoint(split_dir / "checkpoints" / "step_000002")
    assert saved.ep == 2
    with safe_open(str(saved.path / "model_tp0_pp0_ep1.safetensors"), "pt") as f:
        # expert rank 1's file: its routed experts only; the shared expert is in rank 0's
        assert all(".local_experts.2." in n or ".local_experts.3." in n for n in f.keys())  # noqa: SIM118
    (tmp_path / "hf").mkdir()
    write_hf_folder(saved, tmp_path / "hf", progress=False)
    resharded = load_hf_state_dict(tmp_path / "hf")
    assert all(torch.equal(split.final_state[k], resharded[k]) for k in split.final_state)

    resumed = run(tiny_overrides(split_dir, 3, **moe), return_final_state=True)
    assert [row["step"] for row in resumed.history] == [1, 2, 3]
    assert _max_diff(resharded, resumed.final_state) > 0, "the resumed step trained nothing"

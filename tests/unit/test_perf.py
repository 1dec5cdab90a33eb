"""MFU: the FLOP count against a hand computation, the peak table, and the plan's trained tokens."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from helpers.models import TINY_HF_CONFIG

from megarl.models.spec import spec_from_hf_config
from megarl.trainer import perf

# h=64, f=96, d=16, n=4 query heads, g=2 KV heads, L=2 layers, V=100
SPEC = spec_from_hf_config(dict(TINY_HF_CONFIG, vocab_size=100, num_hidden_layers=2))


def test_dense_flops_per_token_by_hand():
    qkv = 2 * 64 * 16 * (4 + 2 * 2)  # 16384
    proj = 2 * 4 * 16 * 64  # 8192
    mlp = 2 * 3 * 64 * 96  # 36864
    head = 2 * 64 * 100  # 12800
    assert perf.dense_forward_flops_per_token(SPEC) == 2 * (qkv + proj + mlp) + head == 135680


def test_attention_term_is_causal_and_per_sequence():
    # S=3: token t attends to t keys -> 1+2+3 = 6 (query, key) pairs; 4 n d FLOPs per pair/layer
    assert perf.attention_forward_flops(SPEC, 3) == 2 * 4 * 4 * 16 * 6 == 3072
    packed = perf.forward_flops(SPEC, [3, 5])
    assert packed == 135680 * 8 + perf.attention_forward_flops(
        SPEC, 3
    ) + perf.attention_forward_flops(SPEC, 5)
    assert packed < perf.forward_flops(SPEC, [8])  # two sequences attend less than one long one
    assert perf.training_flops(SPEC, [3, 5]) == 3 * packed


def test_dense_term_matches_six_n_for_matmul_parameters():
    """Training dense FLOPs per token = 6 x (linear-layer parameters incl. the LM head)."""
    h, f, d, n, g, V, L = 64, 96, 16, 4, 2, 100, 2
    matmul_params = L * (h * d * (n + 2 * g) + n * d * h + 3 * h * f) + h * V
    assert 3 * perf.dense_forward_flops_per_token(SPEC) == 6 * matmul_params


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
    ],
)
def test_peak_table(name, peak):
    assert perf.peak_flops(name).flops_per_s == peak


def test_unknown_device_gives_nan_with_a_note():
    for name in (None, "Tesla T4"):
        peak = perf.peak_flops(name)
        assert peak.flops_per_s is None and "not computed" in peak.note
        assert math.isnan(perf.mfu(1e12, 1.0, 1, peak))


def test_update_metrics_from_a_plan():
    mb = lambda *idx: SimpleNamespace(seq_indices=idx)  # noqa: E731
    step = lambda ghost, *ranks: SimpleNamespace(  # noqa: E731
        is_ghost=ghost, ranks=[SimpleNamespace(micro_batches=r) for r in ranks]
    )
    plan = SimpleNamespace(
        optimizer_steps=[
            step(False, [mb(0, 1)], [mb(2)]),
            step(True, [mb(3)], [mb(3)]),  # a ghost step trains nothing
        ]
    )
    seq_lens = [3, 5, 4, 7]
    peak = perf.PeakFlops(1e12, "test")
    out = perf.update_metrics(SPEC, plan, seq_lens, update_seconds=2.0, num_devices=2, peak=peak)
    flops = perf.training_flops(SPEC, [3, 5, 4])
    assert out["perf/mfu/actor"] == pytest.approx(flops / (2.0 * 2 * 1e12))
    assert out["perf/actor_tokens_per_s"] == pytest.approx(12 / 2.0)
    assert out["perf/actor_tflops"] == pytest.approx(flops / 1e12)

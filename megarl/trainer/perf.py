"""Model FLOPs utilisation (MFU) and throughput: pure functions of the model shape and timings.

FLOPs are counted the usual way for dense decoders (one multiply-add = 2 FLOPs; a backward pass
costs twice the forward, so training = 3 x forward, i.e. "6 x parameters per token"):

Forward, per token and layer (``h`` hidden, ``f`` FFN, ``d`` head dim, ``n``/``g`` query/KV
heads, ``V`` vocabulary):

- QKV projection ``2 h d (n + 2g)``; output projection ``2 n d h``; SwiGLU MLP ``2 * 3 h f``;
- attention scores and weighted sum: a causal token at position ``t`` (1-based) attends to ``t``
  keys, ``2 * 2 n d t`` -- summed over a sequence of ``S`` tokens: ``4 n d S (S + 1) / 2``.

Plus the LM head, ``2 h V`` per token. Embedding lookups, norms and softmax are not counted
(the convention of the MFU numbers peers publish). Packed micro-batches attend per sequence, so
the attention term uses each sequence's own length, never the packed row's.

Peak FLOPs are dense bf16 tensor-core numbers per device, looked up by
``torch.cuda.get_device_name()``; an unknown device (or the CPU) has no peak and MFU is NaN
(written as null) with a note naming the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from megarl.models.spec import TransformerSpec

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity). First match wins, so
# specific names precede general ones.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIE", 756e12),
    ("H100", 989e12),  # SXM / HBM3
    ("A100", 312e12),
)


@dataclass(frozen=True)
class PeakFlops:
    flops_per_s: float | None
    note: str


def peak_flops(device_name: str | None) -> PeakFlops:
    """Dense bf16 peak of one device named like ``torch.cuda.get_device_name()``."""
    if not device_name:
        return PeakFlops(None, "no CUDA device: MFU not computed")
    upper = device_name.upper()
    for key, flops in PEAK_BF16_FLOPS:
        if key in upper:
            return PeakFlops(flops, f"{device_name}: {flops / 1e12:.0f} TFLOP/s bf16 dense")
    return PeakFlops(None, f"{device_name}: peak FLOPs unknown, MFU not computed")


def dense_forward_flops_per_token(spec: TransformerSpec) -> int:
    """Matmul FLOPs of one token's forward pass, excluding attention over the context."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    n, g = spec.num_heads, spec.num_kv_heads
    per_layer = 2 * h * d * (n + 2 * g) + 2 * n * d * h + 2 * 3 * h * f
    return spec.num_layers * per_layer + 2 * h * spec.vocab_size


def attention_forward_flops(spec: TransformerSpec, seq_len: int) -> int:
    """Causal score + weighted-sum FLOPs of one sequence of ``seq_len`` tokens (all layers)."""
    return spec.num_layers * 4 * spec.num_heads * spec.head_dim * seq_len * (seq_len + 1) // 2


def forward_flops(spec: TransformerSpec, seq_lens: Iterable[int]) -> int:
    """Forward FLOPs of the given sequences (each attends only to itself)."""
    dense = dense_forward_flops_per_token(spec)
    return sum(dense * s + attention_forward_flops(spec, s) for s in seq_lens)


def training_flops(spec: TransformerSpec, seq_lens: Iterable[int]) -> int:
    """Forward + backward FLOPs (3 x forward)."""
    return 3 * forward_flops(spec, seq_lens)


def mfu(flops: float, seconds: float, num_devices: int, peak: PeakFlops) -> float:
    """Achieved over peak FLOP/s across ``num_devices``; NaN when the peak is unknown."""
    if peak.flops_per_s is None or seconds <= 0 or num_devices <= 0:
        return math.nan
    return flops / (seconds * num_devices * peak.flops_per_s)


def trained_seq_lens(plan, seq_lens: list[int]) -> list[int]:
    """Lengths of every sequence the plan's optimizer steps run, over all DP ranks and epochs
    (fillers included: they cost a forward and backward like any other)."""
    return [
        seq_lens[i]
        for step in plan.optimizer_steps
        if not step.is_ghost
        for rank in step.ranks
        for mb in rank.micro_batches
        for i in mb.seq_indices
    ]


def update_metrics(
    spec: TransformerSpec,
    plan,
    seq_lens: list[int],
    update_seconds: float,
    num_devices: int,
    peak: PeakFlops,
) -> dict[str, float | str]:
    """``perf/mfu/actor`` of the update phase, its FLOPs and trained tokens per second."""
    lens = trained_seq_lens(plan, seq_lens)
    flops = training_flops(spec, lens)
    return {
        "perf/mfu/actor": mfu(flops, update_seconds, num_devices, peak),
        "perf/actor_tflops": flops / 1e12,
        "perf/actor_tokens_per_s": sum(lens) / update_seconds if update_seconds > 0 else math.nan,
        "perf/mfu_note": peak.note,
    }

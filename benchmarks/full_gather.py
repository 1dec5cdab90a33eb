"""Benchmark baseline: gather Megatron TP/PP shards into HF-named full tensors on global rank 0.

The simple, correct baseline: each parameter's TP shards are all-gathered inside its TP group,
turned into HF tensors by the family's mapping table, and each pipeline stage's (DP rank 0,
TP rank 0) hands its stage's tensors to global rank 0. Every rank must call
:func:`gather_hf_state_dict` (it is a collective). Runs do not use it: the weight sync and the
final state go through the bucketed :mod:`megarl.export.stream`, which never holds the whole
model on one rank. It lives here, beside the benchmarks that measure against it
(``bench_export.py``: streaming vs full gather; ``bench_lora_sync.py``: adapter-only vs full sync).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megarl.export.lora import all_gather_tp, gather_stages_to_rank0
from megarl.models import mapping
from megarl.models.spec import TransformerSpec


def _stage_hf_tensors(local_params: Iterable, spec: TransformerSpec) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out: dict[str, torch.Tensor] = {}
    for rule, layer, param in local_params:
        shards = all_gather_tp(param, tp, group)
        if rule.layout == "replicated":
            shards = shards[:1]
        for name, tensor in zip(
            rule.hf_names(layer), mapping.to_hf(rule, shards, spec), strict=True
        ):
            out.setdefault(
                name, tensor.float().clone() if tensor.dtype != torch.float32 else tensor.clone()
            )
    return out


def gather_hf_state_dict(
    local_params: Iterable, spec: TransformerSpec, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """Full HF state dict on global rank 0 (``None`` elsewhere). Collective over all ranks."""
    parts = gather_stages_to_rank0(_stage_hf_tensors(local_params, spec))
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.items():
            merged.setdefault(name, tensor if dtype is None else tensor.to(dtype))
    return merged

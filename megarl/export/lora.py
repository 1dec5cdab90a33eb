"""Export LoRA adapters from Megatron TP/PP shards under peft's Hugging Face names.

Adapters are small (rank x (in + out) per linear), so this is a plain gather, kept apart from the
base-weight exporter: each adapter's TP shards are all-gathered inside its TP group, turned into
HF tensors, and every pipeline stage's (DP 0, TP 0) rank hands its stage's adapters to global
rank 0.

Layout (see :mod:`megarl.models.lora` for the sharding):

* column-parallel targets: ``lora_A`` is replicated and goes unchanged to every HF module the
  fused Megatron linear stands for (q, k and v for ``linear_qkv``; gate and up for
  ``linear_fc1``), since ``[q; k; v] = [B_q; B_k; B_v] A x``; ``lora_B``'s gathered shards are
  split exactly like the base weight by the family's mapping rule (per-query-group QKV, the
  ``[gate_r; up_r]`` chunks).
* row-parallel targets (``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj``):
  ``lora_A``'s shards are concatenated along the input dimension; ``lora_B`` is replicated.

Names are those of ``peft.get_peft_model_state_dict`` (and of ``adapter_model.safetensors``):
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.models import mapping
from megarl.models.lora import LoraSettings, hf_target_modules, iter_adapters
from megarl.models.spec import TransformerSpec

PEFT_PREFIX = "base_model.model."
"""What PEFT puts in front of the wrapped model's module names in its adapter tensor names."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def peft_name(hf_weight_name: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight``, "lora_A" -> peft's adapter tensor name."""
    return f"{PEFT_PREFIX}{hf_weight_name.removesuffix('.weight')}.{which}.weight"


def adapter_to_hf(
    rule: mapping.ParamRule,
    layer: int,
    parallel: str,
    a_shards: list[torch.Tensor],
    b_shards: list[torch.Tensor],
    spec: TransformerSpec,
) -> dict[str, torch.Tensor]:
    """PEFT-named tensors of one adapted linear from all TP shards of its ``A`` and ``B``.

    Pure tensor code: for a replicated factor pass one shard (any TP rank's).
    """
    hf_names = rule.hf_names(layer)
    if parallel == "column":
        a_full = a_shards[0]
        b_parts = mapping.to_hf(rule, b_shards, spec)
    else:
        a_full = torch.cat(list(a_shards), dim=1)
        b_parts = (b_shards[0],)
    out: dict[str, torch.Tensor] = {}
    for hf_name, b_part in zip(hf_names, b_parts, strict=True):
        out[peft_name(hf_name, "lora_A")] = a_full
        out[peft_name(hf_name, "lora_B")] = b_part
    return out


def adapter_from_hf(
    rule: mapping.ParamRule,
    layer: int,
    parallel: str,
    tensors: Mapping[str, torch.Tensor],
    spec: TransformerSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of one adapted linear at TP=1 from the peft-named tensors
    :func:`adapter_to_hf` gives (the inverse, tested bitwise): a column target's ``A`` is the
    one every HF module shares, its ``B`` the HF parts fused by the base weight's rule."""
    hf_names = rule.hf_names(layer)
    a_full = tensors[peft_name(hf_names[0], "lora_A")]
    if parallel == "column":
        b_parts = [tensors[peft_name(name, "lora_B")] for name in hf_names]
        return a_full, mapping.to_mcore_shard(rule, b_parts, spec, 0, 1)
    return a_full, tensors[peft_name(hf_names[0], "lora_B")]


def all_gather_tp(tensor: torch.Tensor, tp: int, group: Any) -> list[torch.Tensor]:
    """Every TP rank's shard of ``tensor``, in TP-rank order, on every rank of ``group``."""
    if tp == 1:
        return [tensor.detach()]
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return shards


def _stage_adapter_tensors(model, spec: TransformerSpec) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out: dict[str, torch.Tensor] = {}
    for site in iter_adapters(model, spec):
        adapter = site.adapter
        row = adapter.parallel == "row"
        a_shards = all_gather_tp(adapter.lora_A, tp, group) if row else [adapter.lora_A.detach()]
        b_shards = [adapter.lora_B.detach()] if row else all_gather_tp(adapter.lora_B, tp, group)
        tensors = adapter_to_hf(site.rule, site.layer, adapter.parallel, a_shards, b_shards, spec)
        out.update({name: t.float().clone() for name, t in tensors.items()})
    return out


def gather_peft_adapter(model, spec: TransformerSpec) -> dict[str, torch.Tensor] | None:
    """The whole adapter, peft-named, fp32, on global rank 0 (``None`` elsewhere).

    A collective: every rank must call it. Also what a checkpoint converter needs to write a
    peft adapter folder (with :func:`save_peft_adapter`) or merged weights (with
    :func:`merge_adapter_into_hf`).
    """
    parts = gather_stages_to_rank0(_stage_adapter_tensors(model, spec))
    if parts is None:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def gather_stages_to_rank0(
    stage_tensors: dict[str, torch.Tensor],
) -> list[dict[str, torch.Tensor]] | None:
    """Each pipeline stage's ``stage_tensors`` (from its DP 0, TP 0 rank), in global-rank order,
    on global rank 0; ``None`` elsewhere. A collective: every rank must call it."""
    from megatron.core import parallel_state as ps

    owner = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    payload = stage_tensors if owner else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return [stage_tensors]
    gathered: list[dict[str, torch.Tensor] | None] | None = None
    if dist.get_rank() == 0:
        gathered = [None for _ in range(world)]
    dist.gather_object(payload, gathered, dst=0)
    if gathered is None:
        return None
    return [part for part in gathered if part is not None]


# --- peft folder and merging (pure: no torch.distributed) ------------------------------------


def peft_adapter_config(
    settings: LoraSettings, spec: TransformerSpec, base_model: str | None = None
) -> dict:
    """``adapter_config.json`` content that ``peft.PeftModel.from_pretrained`` and vLLM accept."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": hf_target_modules(spec, settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_peft_adapter(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor],
    settings: LoraSettings,
    spec: TransformerSpec,
    base_model: str | None = None,
) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (a peft adapter folder)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        str(folder / ADAPTER_WEIGHTS_FILE),
    )
    config = peft_adapter_config(settings, spec, base_model)
    (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return folder


def merge_adapter_into_hf(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """HF state dict with ``W + scaling * B @ A`` for every adapted module (base untouched)."""
    merged = dict(base)
    for name, a in adapter.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        weight = base[f"{module}.weight"]
        delta = (b.double() @ a.double()) * scaling
        merged[f"{module}.weight"] = (weight.double() + delta).to(weight.dtype)
    return merged

"""LoRA adapters in checkpoints: keys, TP resharding, and full PEFT tensors from saved shards.

No process groups and no megatron here: the trainer calls the save/load helpers per rank with
its adapter sites, the converter calls :func:`peft_adapter_from_checkpoint` on the shard files.

Each adapter factor is stored under the Megatron parameter name with the *global* layer number
(``decoder.layers.3.self_attention.linear_qkv.lora.lora_A``), its AdamW state under the same
prefixes as base weights (``exp_avg/<key>``). Every TP rank writes its own copy of a replicated
factor (small), so a resume at the same layout reads back exactly what each rank held.

How a factor is split over TP follows :mod:`megarl.models.lora`: the factor on the TP-split side
of the base weight (``lora_B`` of a column-parallel linear, ``lora_A`` of a row-parallel one) is
split *exactly like the base weight* (per-query-group QKV, ``[gate_r; up_r]``, column chunks),
the other one is replicated. Resharding therefore reuses the base weight's mapping rule: saved
shards -> full (HF-ordered) parts -> new shards, pure re-indexing and bitwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megarl.models import mapping
from megarl.models.lora import ADAPTER_ATTR, TARGET_PARALLELISM, weight_template
from megarl.models.spec import TransformerSpec

FACTORS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class SavedSite:
    """One adapted linear as a checkpoint sees it: base weight's rule, global layer, split side."""

    rule: mapping.ParamRule
    layer: int
    parallel: str  # "column" | "row"


def adapter_key(rule: mapping.ParamRule, layer: int, factor: str) -> str:
    """``decoder.layers.{layer}.<block>.<target>.lora.<factor>`` for the base weight's rule."""
    return f"{rule.mcore_name(layer).removesuffix('.weight')}.{ADAPTER_ATTR}.{factor}"


def is_split(parallel: str, factor: str) -> bool:
    """Whether ``factor`` is split over TP (like the base weight) or replicated."""
    return (parallel, factor) in (("column", "lora_B"), ("row", "lora_A"))


def site_tensors(
    site: SavedSite, a: torch.Tensor, b: torch.Tensor, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``{prefix + key: tensor}`` of one rank's adapter factors (or their optimizer states)."""
    return {
        prefix + adapter_key(site.rule, site.layer, "lora_A"): a,
        prefix + adapter_key(site.rule, site.layer, "lora_B"): b,
    }


def reshard_factor(
    site: SavedSite,
    factor: str,
    saved: list[torch.Tensor],
    spec: TransformerSpec,
    tp_rank: int,
    tp: int,
) -> torch.Tensor:
    """What TP rank ``tp_rank`` of ``tp`` holds of a factor, from all saved TP shards of it."""
    if not is_split(site.parallel, factor):
        return saved[0].clone()
    full = mapping.to_hf(site.rule, saved, spec)
    return mapping.to_mcore_shard(site.rule, full, spec, tp_rank, tp)


def saved_sites(spec: TransformerSpec, targets: Iterable[str]) -> Iterator[SavedSite]:
    """Every adapted linear of the whole model (all layers) for ``actor.lora.target_modules``."""
    rules = mapping.rule_index(spec)
    targets = list(targets)
    for layer in range(spec.num_layers):
        for target, parallel in TARGET_PARALLELISM.items():
            if target in targets:
                yield SavedSite(rules[weight_template(target)], layer, parallel)


def peft_adapter_from_checkpoint(
    read, saved_tp: int, spec: TransformerSpec, targets: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The whole adapter under peft's names, fp32, assembled from saved shards.

    ``read(key, tp_rank)`` returns one saved tensor (:meth:`ShardReader.read`).
    """
    from megarl.export.lora import adapter_to_hf

    out: dict[str, torch.Tensor] = {}
    for site in saved_sites(spec, targets):
        shards = {}
        for factor in FACTORS:
            key = adapter_key(site.rule, site.layer, factor)
            ranks = range(saved_tp) if is_split(site.parallel, factor) else [0]
            shards[factor] = [read(key, t) for t in ranks]
        tensors = adapter_to_hf(
            site.rule, site.layer, site.parallel, shards["lora_A"], shards["lora_B"], spec
        )
        out.update({name: t.float().clone() for name, t in tensors.items()})  # A is shared
    return out

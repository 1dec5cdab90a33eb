"""Megatron shards on disk: write one rank's shards, read them back at any TP/PP layout.

No process groups here: the trainer calls these per rank, the converters call them in a loop
over virtual ranks. Tensors are keyed by Megatron name with the *global* layer number
(``decoder.layers.17.mlp.linear_fc1.weight``), so a file does not depend on which pipeline stage
wrote it; optimizer states use the same keys under a prefix (``exp_avg/<name>``).

Reading at another TP size goes saved shards -> HF tensors -> new shards through
:mod:`megarl.models.mapping` (pure re-indexing, hence bitwise). PP needs nothing: global layer
names are found in whichever file holds them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megarl.checkpoint import lora_shards
from megarl.checkpoint.layout import CheckpointError, CheckpointInfo, model_file, optim_file
from megarl.models import mapping
from megarl.models.spec import TransformerSpec

if TYPE_CHECKING:
    from safetensors import safe_open

OPTIM_MOMENTS = ("exp_avg", "exp_avg_sq")
SAFETENSORS_METADATA = {"format": "pt"}


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """safetensors file, fsynced (the marker that follows must not outlive the data)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        str(path),
        metadata=SAFETENSORS_METADATA,
    )
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def rank_shards(local_params: Iterable, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{global Megatron name: shard}`` of this rank (first copy of a tied embedding wins);
    ``prefix`` keeps a second model's shards (the critic's ``critic/``) apart in one file."""
    out: dict[str, torch.Tensor] = {}
    for rule, layer, param in local_params:
        out.setdefault(prefix + rule.mcore_name(layer), param.detach())
    return out


def rank_optimizer_state(
    local_params: Iterable, states: Mapping[torch.nn.Parameter, dict], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``{"<state key>/<prefix><name>": tensor}`` for every parameter with optimizer state
    (``states``: the optimizer's ``param_states()``)."""
    out: dict[str, torch.Tensor] = {}
    for rule, layer, param in local_params:
        name = prefix + rule.mcore_name(layer)
        for key, value in states.get(param, {}).items():
            out.setdefault(f"{key}/{name}", _stored(value))
    return out


def _stored(value: torch.Tensor) -> torch.Tensor:
    """0-d tensors (the step count) are stored with shape [1]."""
    return value.reshape(1) if value.dim() == 0 else value


class ShardReader:
    """Lazy reads of one checkpoint's shards, resharded to the caller's TP layout."""

    def __init__(self, info: CheckpointInfo, spec: TransformerSpec, optimizer: bool = False):
        self.info, self.spec = info, spec
        self.saved_tp = info.tp
        self._file_of: list[dict[str, Path]] = [{} for _ in range(self.saved_tp)]
        self._handles: dict[Path, safe_open] = {}
        files = [model_file] + ([optim_file] if optimizer else [])
        for t in range(self.saved_tp):
            for p in range(info.pp):
                for e in range(info.ep):
                    for name_of in files:
                        self._index(t, info.path / name_of(t, p, e))

    def _index(self, tp_rank: int, path: Path) -> None:
        from safetensors import safe_open

        if not path.is_file():
            raise CheckpointError(f"checkpoint {self.info.path}: missing {path.name}")
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                self._file_of[tp_rank].setdefault(key, path)

    def has(self, key: str) -> bool:
        return key in self._file_of[0]

    def read(self, key: str, tp_rank: int) -> torch.Tensor:
        from safetensors import safe_open

        path = self._file_of[tp_rank].get(key)
        if path is None:
            raise CheckpointError(
                f"checkpoint {self.info.path}: no tensor {key} for TP rank {tp_rank}"
            )
        if path not in self._handles:  # memory-mapped; only the tensors read are paged in
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(key)

    def saved_shards(
        self, rule: mapping.ParamRule, layer: int | None, prefix: str = ""
    ) -> list[torch.Tensor]:
        key = prefix + rule.mcore_name(layer)
        if rule.layout == "replicated":
            return [self.read(key, 0)]
        return [self.read(key, t) for t in range(self.saved_tp)]

    def hf_tensors(
        self, rule: mapping.ParamRule, layer: int | None, prefix: str = ""
    ) -> tuple[torch.Tensor, ...]:
        return mapping.to_hf(rule, self.saved_shards(rule, layer, prefix), self.spec)

    def shard(
        self, rule: mapping.ParamRule, layer: int | None, tp_rank: int, tp: int, prefix: str = ""
    ) -> torch.Tensor:
        """What TP rank ``tp_rank`` of ``tp`` holds of this parameter (or its optimizer state)."""
        if tp == self.saved_tp:
            return self.read(prefix + rule.mcore_name(layer), tp_rank)
        return mapping.to_mcore_shard(
            rule, self.hf_tensors(rule, layer, prefix), self.spec, tp_rank, tp
        )


@torch.no_grad()
def load_rank_shards(
    reader: ShardReader, local_params: Iterable, tp_rank: int, tp: int, prefix: str = ""
) -> int:
    """Copy this rank's shards from the checkpoint into the model; returns params loaded."""
    count = 0
    for rule, layer, param in local_params:
        shard = reader.shard(rule, layer, tp_rank, tp, prefix=prefix)
        _check_shape(shard, param, prefix + rule.mcore_name(layer))
        param.copy_(shard.to(param.dtype))
        count += 1
    return count


def load_rank_optimizer_state(
    reader: ShardReader,
    local_params: Iterable,
    optimizer,
    tp_rank: int,
    tp: int,
    prefix: str = "",
) -> int:
    """Restore this rank's optimizer state from the checkpoint; returns params restored. The
    weights must be loaded first (a GPU optimizer's saved fp32 ``main_param`` replaces the
    copy it refreshed from them)."""
    count = 0
    for rule, layer, param in local_params:
        name = prefix + rule.mcore_name(layer)
        if not reader.has(f"step/{name}"):
            continue  # saved before the first optimizer step
        state = {"step": reader.read(f"step/{name}", 0).reshape(())}
        for key in saved_state_keys(reader, name):
            state[key] = reader.shard(rule, layer, tp_rank, tp, prefix=f"{key}/{prefix}")
            _check_shape(state[key], param, f"{key}/{name}")
        optimizer.load_param_state(param, state)
        count += 1
    return count


def saved_state_keys(reader: ShardReader, name: str) -> tuple[str, ...]:
    """The per-element state saved for ``name``: Adam's moments, and the fp32 main copy where
    a mixed-precision (GPU) run saved one."""
    optional = ("main_param",) if reader.has(f"main_param/{name}") else ()
    return OPTIM_MOMENTS + optional


# --- LoRA adapters (megarl.checkpoint.lora_shards): sites = (SavedSite, LoraAdapter) ----------


def rank_adapter_shards(sites: Iterable) -> dict[str, torch.Tensor]:
    """``{adapter key: this rank's factor}`` for every adapter this rank holds."""
    out: dict[str, torch.Tensor] = {}
    for site, adapter in sites:
        out.update(lora_shards.site_tensors(site, adapter.lora_A.detach(), adapter.lora_B.detach()))
    return out


def rank_adapter_optimizer_state(
    sites: Iterable, states: Mapping[torch.nn.Parameter, dict]
) -> dict[str, torch.Tensor]:
    """``{"<state key>/<adapter key>": tensor}`` (the optimizer holds only adapter params with
    LoRA; ``states``: its ``param_states()``)."""
    out: dict[str, torch.Tensor] = {}
    for site, adapter in sites:
        for factor in lora_shards.FACTORS:
            key = lora_shards.adapter_key(site.rule, site.layer, factor)
            for name, value in states.get(getattr(adapter, factor), {}).items():
                out[f"{name}/{key}"] = _stored(value)
    return out


def _adapter_factor(
    reader: ShardReader, site, factor: str, tp_rank: int, tp: int, prefix: str = ""
) -> torch.Tensor:
    key = prefix + lora_shards.adapter_key(site.rule, site.layer, factor)
    if tp == reader.saved_tp:
        return reader.read(key, tp_rank)
    split = lora_shards.is_split(site.parallel, factor)
    saved = [reader.read(key, t) for t in (range(reader.saved_tp) if split else [0])]
    return lora_shards.reshard_factor(site, factor, saved, reader.spec, tp_rank, tp)


@torch.no_grad()
def load_rank_adapters(reader: ShardReader, sites: Iterable, tp_rank: int, tp: int) -> int:
    """Copy this rank's adapter factors in; returns factors loaded."""
    count = 0
    for site, adapter in sites:
        for factor in lora_shards.FACTORS:
            param = getattr(adapter, factor)
            key = lora_shards.adapter_key(site.rule, site.layer, factor)
            if not reader.has(key):
                raise CheckpointError(
                    f"checkpoint {reader.info.path} holds no LoRA adapter "
                    f"tensor {key} (saved without actor.lora?)"
                )
            value = _adapter_factor(reader, site, factor, tp_rank, tp)
            _check_shape(value, param, key)
            param.copy_(value.to(param.dtype))
            count += 1
    return count


def load_rank_adapter_optimizer_state(
    reader: ShardReader, sites: Iterable, optimizer, tp_rank: int, tp: int
) -> int:
    """The adapters' optimizer state, after their weights; returns factors restored."""
    count = 0
    for site, adapter in sites:
        for factor in lora_shards.FACTORS:
            param = getattr(adapter, factor)
            key = lora_shards.adapter_key(site.rule, site.layer, factor)
            if not reader.has(f"step/{key}"):
                continue  # saved before the first optimizer step
            state = {"step": reader.read(f"step/{key}", 0).reshape(())}
            for name in saved_state_keys(reader, key):
                state[name] = _adapter_factor(reader, site, factor, tp_rank, tp, f"{name}/")
                _check_shape(state[name], param, f"{name}/{key}")
            optimizer.load_param_state(param, state)
            count += 1
    return count


def _check_shape(tensor: torch.Tensor, param: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the "
            f"model's is {tuple(param.shape)}"
        )


# --- offline (converter) side: all virtual ranks of a layout --------------------------------


def stage_params(
    spec: TransformerSpec, pp_rank: int, pp: int
) -> Iterator[tuple[mapping.ParamRule, int | None]]:
    """``(rule, global layer)`` of every parameter Megatron puts on pipeline stage ``pp_rank``."""
    per_stage = spec.num_layers // pp
    layers = range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    first, last = pp_rank == 0, pp_rank == pp - 1
    for rule in mapping.rules_for(spec):
        if rule.per_layer:
            for layer in layers:
                yield rule, layer
        elif rule.mcore.startswith("embedding."):
            if first:
                yield rule, None
        elif rule.mcore == "output_layer.weight":
            if last and not spec.tie_embeddings:
                yield rule, None
        elif last:
            yield rule, None


def hf_state_from_checkpoint(reader: ShardReader, progress=None) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model, reassembled from the checkpoint's shards."""
    spec = reader.spec
    out: dict[str, torch.Tensor] = {}
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            for name, tensor in zip(
                rule.hf_names(layer), reader.hf_tensors(rule, layer), strict=True
            ):
                out[name] = tensor.contiguous()
            if progress is not None:
                progress()
    return out

"""Per-parameter state of Megatron-Core's optimizers, in and out of megarl's checkpoint format.

A megarl checkpoint holds each model parameter's optimizer state shaped like the parameter
(``exp_avg``, ``exp_avg_sq``, ``step``: :mod:`megarl.checkpoint`), so the state reshards across
TP/PP/EP exactly as the weights do. On CUDA the actor trains with Megatron's optimizer, which
keeps that state elsewhere, in three ways this module undoes:

* **Mixed precision.** The optimizer updates an fp32 *main* copy of every bf16 parameter and
  rounds it into the model after each step. The bf16 weights alone cannot resume a run exactly,
  so the main copy is saved too, as ``main_param``; loading puts it back after the weights.
* **The distributed optimizer.** Each data-parallel rank holds the main copy and the Adam
  moments of one contiguous slice of every gradient bucket, and the slices cut parameters
  anywhere. Saving assembles every parameter's full state on the DP group's first rank, the
  one that writes the file (a sum over the group of zero-padded slices: the slices are
  disjoint, so each element is one rank's value plus zeros); loading hands every rank its own
  slice of the file's tensor.
* **The step count.** TE's and apex's FusedAdam keep it per parameter group, ``torch.optim``
  per parameter; the checkpoint stores it per parameter (as :class:`torch.optim.AdamW` does).

Collectives are ordered by each gradient buffer's parameter list, which is the same on every
rank of a data-parallel group; expert parameters belong to their own optimizer (Megatron
chains one per group), so they gather over the expert-data-parallel group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's per-element state, saved shaped like the parameter."""

Reduce = Callable[[torch.Tensor, object], bool]
"""``reduce(tensor, group)``: sum ``tensor`` over ``group`` onto the group's first rank, in
place; returns whether this rank is that first rank."""


def reduce_to_first_rank(tensor: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    dist.reduce(tensor, dst=dist.get_global_rank(group, 0), group=group)
    return dist.get_rank(group) == 0


def optimizer_parts(optimizer) -> list:
    """The optimizers Megatron chained (one per parameter group kind), or the one itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(part) -> bool:
    """Megatron's DistributedOptimizer (state sharded over the data-parallel group)."""
    return hasattr(part, "model_param_gbuf_map") and hasattr(part, "buffers")


# --- saving ---------------------------------------------------------------------------------


def gather_param_states(
    optimizer, step: int, reduce: Reduce = reduce_to_first_rank
) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """``{model param: {"exp_avg", "exp_avg_sq", "step"[, "main_param"]}}`` shaped like each
    parameter. Collective over every distributed part's data-parallel group; the result holds
    the parameters whose state this rank has in full (for a distributed part: only on the
    group's first rank). ``step`` is the number of optimizer steps taken (0: nothing to save)."""
    if step == 0:
        return {}
    out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    for part in optimizer_parts(optimizer):
        if is_distributed(part):
            out.update(_gather_distributed(part, step, reduce))
        else:
            out.update(_local_states(part, step))
    return out


def _local_states(part, step: int) -> dict:
    out = {}
    for param, main in _model_and_main_params(part):
        state = part.optimizer.state.get(main) or {}
        if not all(key in state for key in MOMENTS):
            continue
        entry = {key: state[key].view(param.shape) for key in MOMENTS}
        if main is not param:
            entry["main_param"] = main.detach().view(param.shape)
        entry["step"] = torch.tensor(float(step))
        out[param] = entry
    return out


def _gather_distributed(part, step: int, reduce: Reduce) -> dict:
    out = {}
    for buffer in part.buffers:
        for param in buffer.params:
            keys = MOMENTS + (("main_param",) if param.dtype != torch.float32 else ())
            full = {
                key: torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                for key in keys
            }
            if param in part.model_param_gbuf_map:  # this rank owns a slice of it
                owned = part._get_model_param_range_map(param)["param"]
                local = part._get_main_param_and_optimizer_states(param)
                for key in keys:
                    source = local["param" if key == "main_param" else key]
                    full[key][owned.start : owned.end] = source.detach().reshape(-1)
            first = False
            for key in keys:
                first = reduce(full[key], part.data_parallel_group)
            if first:
                entry = {key: value.view(param.shape) for key, value in full.items()}
                entry["step"] = torch.tensor(float(step))
                out[param] = entry
    return out


def _model_and_main_params(part) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model param, the tensor the optimizer updates) of a non-distributed part."""
    if hasattr(part, "float16_groups"):  # Float16OptimizerWithFloat16Params
        for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups, strict=True):
            yield from zip(models, mains, strict=True)
        for group in part.fp32_from_fp32_groups:
            for param in group:
                yield param, param
        return
    for group in part.optimizer.param_groups:  # FP32Optimizer
        for param in group["params"]:
            yield param, param


# --- loading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one model parameter's state lives on this rank: ``main`` is the tensor the
    optimizer updates (None: a distributed optimizer gave this rank no slice of it), ``owned``
    its range within the flattened parameter (None: the whole parameter)."""

    inner: torch.optim.Optimizer
    main: torch.Tensor | None
    owned: object | None = None


def index_params(optimizer) -> dict[torch.nn.Parameter, Target]:
    """Every model parameter the optimizer trains, with where its state lives on this rank."""
    index: dict[torch.nn.Parameter, Target] = {}
    for part in optimizer_parts(optimizer):
        if not is_distributed(part):
            for param, main in _model_and_main_params(part):
                index[param] = Target(part.optimizer, main)
            continue
        for buffer in part.buffers:
            for param in buffer.params:
                if param not in part.model_param_gbuf_map:
                    index[param] = Target(part.optimizer, None)
                    continue
                group_index, order = part.model_param_group_index_map[param]
                main = part.optimizer.param_groups[group_index]["params"][order]
                owned = part._get_model_param_range_map(param)["param"]
                index[param] = Target(part.optimizer, main, owned)
    return index


@torch.no_grad()
def load_param_state(target: Target, param: torch.nn.Parameter, state: dict[str, torch.Tensor]):
    """Put one parameter's checkpointed state (shaped like ``param``) into the optimizer: this
    rank's slice of it under the distributed optimizer. Call after the weights are loaded and
    the main copies refreshed from them (``reload_model_params``): a saved ``main_param`` then
    replaces the refreshed, bf16-rounded copy."""
    if target.main is None:
        return
    if "main_param" in state and target.main is not param:
        target.main.copy_(_this_ranks_part(state["main_param"], target))
    slot = target.inner.state[target.main]
    for key in MOMENTS:
        slot[key] = _this_ranks_part(state[key], target).clone()
    _set_step(target.inner, target.main, int(state["step"].item()))


def _this_ranks_part(value: torch.Tensor, target: Target) -> torch.Tensor:
    assert target.main is not None
    flat = value.reshape(-1)
    if target.owned is not None:
        flat = flat[target.owned.start : target.owned.end]  # pyright: ignore[reportAttributeAccessIssue]  # Megatron's Range
    return flat.view(target.main.shape).to(device=target.main.device, dtype=torch.float32)


def _set_step(inner: torch.optim.Optimizer, main: torch.Tensor, step: int) -> None:
    """torch's Adam counts steps per parameter (a tensor in its state); TE's and apex's
    FusedAdam per parameter group."""
    if type(inner).__module__.startswith("torch.optim"):
        inner.state[main]["step"] = torch.tensor(float(step))
        return
    for group in inner.param_groups:
        if any(p is main for p in group["params"]):
            group["step"] = step

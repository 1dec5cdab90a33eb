"""LoRA adapters on Megatron-Core's tensor-parallel linears (``actor.lora.*``).

Why not ``peft`` here: peft 0.21.2's Megatron path (``LoraParallelLinear``, dispatched by
``LoraConfig(megatron_config=...)``) does not run against megatron-core 0.16.1: its dispatcher
reads a ``fan_in_fan_out`` kwarg peft no longer passes (KeyError), its ``update_layer`` skips
the ``lora_bias`` bookkeeping that ``reset_lora_parameters`` reads (KeyError), and its forward
multiplies the ``(output, bias)`` tuple Megatron's parallel linears return by the scaling. It
also mutates the ``TransformerConfig`` it is given. Instead this module adds the low-rank delta
with a forward hook on the *unchanged* Megatron layer, using only Megatron's public
tensor-parallel region functions, so the base parameter names (which the mapping tables, the
exporter and checkpoints key on) stay exactly as they were. peft stays the interface on the
Hugging Face side: adapters are exported under peft's names (:mod:`megarl.export.lora`) and
engines load them with peft (transformers) or as vLLM LoRA requests.

Sharding (``y = W x + s * B A x`` with ``s = alpha / rank``), chosen so every TP rank computes
its part of the delta with one all-reduce of a rank-``r`` activation and no weight gathers:

* column-parallel base (``linear_qkv``, ``linear_fc1``; output split over TP): ``A`` [r, in] is
  replicated, ``B`` [out/tp, r] is split along its rows exactly like the base weight (so the
  fused per-query-group QKV and ``[gate_r; up_r]`` layouts of :mod:`megarl.models.mapping` apply
  to ``B`` unchanged). ``A x`` enters the TP region with ``copy_to_tensor_model_parallel_region``
  whose backward all-reduces, so ``A``'s gradient is the full one and identical on every TP rank.
* row-parallel base (``linear_proj``, ``linear_fc2``; input split over TP): ``A`` [r, in/tp] is
  split along its columns like the base weight, ``B`` [out, r] is replicated; ``A x_local`` is
  summed over TP with ``reduce_from_tensor_model_parallel_region``.

Initialisation: ``B = 0`` (the model starts equal to the base model) and ``A`` uniform in
``±1/sqrt(in)`` (peft's default, Kaiming-uniform with ``a = sqrt(5)``), drawn for the *full*
matrix from a generator seeded by (seed, global layer, target) and then sliced, so the initial
adapter is the same whatever the TP/PP layout. Adapters take the base weight's dtype. Dropout
(``actor.lora.dropout``) is applied to the adapter's input in training-mode forwards with
gradients on, from a generator seeded like ``A``, so TP ranks that share an input draw the same
mask.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megarl.models import mapping
from megarl.models.chunk import layer_offset, unwrap
from megarl.models.spec import TransformerSpec

TARGET_PARALLELISM: dict[str, str] = {
    "linear_qkv": "column",
    "linear_fc1": "column",
    "linear_proj": "row",
    "linear_fc2": "row",
}
"""Megatron target module -> how its base weight is split over TP."""

ADAPTER_ATTR = "lora"
"""Child-module name of the adapter on a wrapped Megatron linear."""


@dataclass(frozen=True)
class LoraSettings:
    """What the adapters need from ``actor.lora`` (plus the run's seed)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = tuple(TARGET_PARALLELISM)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = [t for t in self.target_modules if t not in TARGET_PARALLELISM]
        if unknown or not self.target_modules:
            raise ValueError(
                f"LoRA target_modules must be a non-empty subset of "
                f"{list(TARGET_PARALLELISM)}, got {list(self.target_modules)}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora_cfg, seed: int) -> LoraSettings:
        return cls(
            rank=lora_cfg.rank,
            alpha=lora_cfg.alpha,
            dropout=lora_cfg.dropout,
            target_modules=tuple(lora_cfg.target_modules),
            seed=seed,
        )


# --- pure naming helpers ---------------------------------------------------------------------


def is_adapter_param_name(name: str) -> bool:
    """Whether a Megatron parameter name belongs to a LoRA adapter (not the base model)."""
    return f".{ADAPTER_ATTR}.lora_A" in name or f".{ADAPTER_ATTR}.lora_B" in name


def hf_target_modules(spec: TransformerSpec, targets: Sequence[str]) -> list[str]:
    """PEFT ``target_modules`` on the HF model for Megatron targets (e.g. linear_qkv -> q/k/v)."""
    rules = mapping.rule_index(spec)
    modules: list[str] = []
    for target in targets:
        rule = rules[weight_template(target)]
        for hf_name in rule.hf:
            module = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
            if module not in modules:
                modules.append(module)
    return modules


def weight_template(target: str) -> str:
    block = "self_attention" if target in ("linear_qkv", "linear_proj") else "mlp"
    return f"decoder.layers.{{layer}}.{block}.{target}.weight"


def init_seed(seed: int, layer: int, target: str) -> int:
    """Stable per-adapter seed (independent of TP/PP layout and of Python's hash salt)."""
    return zlib.crc32(f"{seed}:{layer}:{target}".encode())


# --- the adapter module ----------------------------------------------------------------------


class LoraAdapter(torch.nn.Module):
    """The ``s * B A`` delta beside one Megatron parallel linear (see the module docstring)."""

    def __init__(
        self,
        parallel: str,
        base_weight: torch.Tensor,
        layer: int,
        target: str,
        settings: LoraSettings,
        tp_rank: int,
        tp: int,
    ):
        super().__init__()
        self.parallel, self.layer, self.target = parallel, layer, target
        self.scaling, self.dropout = settings.scaling, settings.dropout
        self.enabled = True  # False inside `adapters_disabled`: the base model's forward
        self._seed = init_seed(settings.seed, layer, target)
        self._dropout_gen: torch.Generator | None = None
        out_local, in_local = base_weight.shape
        in_full = in_local * tp if parallel == "row" else in_local
        out_B = out_local  # column: B is split like W; row: W's rows are already the full out
        a_full = _uniform_init(settings.rank, in_full, self._seed)
        a_local = a_full.chunk(tp, dim=1)[tp_rank] if parallel == "row" else a_full
        kw = {"dtype": base_weight.dtype, "device": base_weight.device}
        self.lora_A = torch.nn.Parameter(a_local.to(**kw).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_B, settings.rank, **kw))
        _mark_tp(self.lora_A if parallel == "row" else self.lora_B, parallel, tp)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = self._apply_dropout(x)
        h = torch.nn.functional.linear(x, self.lora_A)
        if self.parallel == "column":
            h = copy_to_tensor_model_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.lora_B) * self.scaling

    def dropout_rng_state(self) -> tuple[str, torch.Tensor] | None:
        """``(device, state)`` of the dropout generator (None before its first use): a
        training checkpoint saves it so a resumed run draws the masks it would have drawn."""
        gen = self._dropout_gen
        return None if gen is None else (str(gen.device), gen.get_state())

    def set_dropout_rng_state(self, saved: tuple[str, torch.Tensor] | None) -> None:
        if saved is None:
            self._dropout_gen = None
            return
        device, state = saved
        self._dropout_gen = torch.Generator(device=device)
        self._dropout_gen.set_state(state)

    def _apply_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout == 0 or not (self.training and torch.is_grad_enabled()):
            return x
        if self._dropout_gen is None or self._dropout_gen.device != x.device:
            self._dropout_gen = torch.Generator(device=x.device).manual_seed(self._seed)
        keep = torch.rand(x.shape, generator=self._dropout_gen, device=x.device) >= self.dropout
        return x * keep.to(x.dtype) / (1.0 - self.dropout)


def _uniform_init(rank: int, fan_in: int, seed: int) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def _mark_tp(param: torch.nn.Parameter, parallel: str, tp: int) -> None:
    """Mark the TP-split factor so grad norms count it on every rank (replicas count once)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(
        param, is_parallel=tp > 1, dim=1 if parallel == "row" else 0, stride=1
    )


def _lora_sharded_state_dict(module, parallel: str):
    """The linear's ``sharded_state_dict`` with the TP-split adapter factor sharded too.

    Megatron's parallel linears shard only ``weight``/``bias`` and would save every other key
    (our adapter) as a TP replica, which is wrong for ``lora_B`` (column) / ``lora_A`` (row).
    """
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axis_map = (
        {"weight": 0, "bias": 0, f"{ADAPTER_ATTR}.lora_B": 0}
        if parallel == "column"
        else {"weight": 1, f"{ADAPTER_ATTR}.lora_A": 1}
    )

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            module.state_dict(prefix="", keep_vars=True),
            prefix,
            axis_map,
            sharded_offsets,
            tp_group=getattr(module, "tp_group", None),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    return sharded_state_dict


def _add_lora_delta(module, args, output):
    """Forward hook on a Megatron parallel linear: ``(W x, bias) -> (W x + s B A x, bias)``."""
    adapter = getattr(module, ADAPTER_ATTR)
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter.delta(args[0]).to(out.dtype), bias


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[int]:
    """Forwards inside run the frozen base model, every adapter's delta left out.

    With LoRA the base weights never change, so this *is* the initial policy: the reference for
    a KL term, without building a second model (:func:`megarl.planner.gates.decide_reference`).
    Every TP rank must enter it together (a row-parallel delta would all-reduce). Yields the
    number of adapters switched off.
    """
    adapters = [m for m in unwrap(model).modules() if isinstance(m, LoraAdapter)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield len(adapters)
    finally:
        for adapter in adapters:
            adapter.enabled = True


# --- applying and finding adapters -----------------------------------------------------------


def apply_lora(model, spec: TransformerSpec, settings: LoraSettings) -> int:
    """Add adapters to the target linears of this rank's stage and freeze everything else.

    Must run before DDP wrapping (DDP then builds grad buffers for the adapters only).
    Returns the number of adapted linears.
    """
    from megatron.core import parallel_state as ps

    bare = unwrap(model)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    offset = layer_offset(bare)
    count = 0
    for name, module in list(bare.named_modules()):
        target = name.rsplit(".", 1)[-1]
        if target not in settings.target_modules:
            continue
        parallel = TARGET_PARALLELISM[target]
        _require_local_linear(name, module, parallel)
        _, local_layer = mapping.split_layer_name(name)
        if local_layer is None:
            raise ValueError(f"LoRA target {name} is not inside a transformer layer")
        adapter = LoraAdapter(
            parallel, module.weight, local_layer + offset, target, settings, tp_rank, tp
        )
        module.add_module(ADAPTER_ATTR, adapter)
        module.register_forward_hook(_add_lora_delta)
        module.sharded_state_dict = _lora_sharded_state_dict(module, parallel)
        count += 1
    for name, param in bare.named_parameters():
        param.requires_grad_(is_adapter_param_name(name))
    return count


def _require_local_linear(name: str, module, parallel: str) -> None:
    """Only Megatron's plain parallel linears: a transformer-engine ``linear_qkv`` fuses the
    input layernorm, so a hook would see the un-normalised input."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    expected = ColumnParallelLinear if parallel == "column" else RowParallelLinear
    if type(module) is not expected:
        raise TypeError(
            f"LoRA supports Megatron's local {expected.__name__} for {name}, "
            f"got {type(module).__name__} (transformer-engine spec?)"
        )


@dataclass(frozen=True)
class AdapterSite:
    """One adapted linear on this rank: where it is and the base weight's mapping rule."""

    rule: mapping.ParamRule
    layer: int
    adapter: LoraAdapter


def iter_adapters(model, spec: TransformerSpec) -> Iterator[AdapterSite]:
    """This rank's adapters in module order, each with its base weight's mapping rule."""
    rules = mapping.rule_index(spec)
    for module in unwrap(model).modules():
        adapter = getattr(module, ADAPTER_ATTR, None)
        if isinstance(adapter, LoraAdapter):
            yield AdapterSite(rules[weight_template(adapter.target)], adapter.layer, adapter)


def adapter_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable adapter parameters (what the optimizer and DDP see)."""
    return [p for n, p in unwrap(model).named_parameters() if is_adapter_param_name(n)]

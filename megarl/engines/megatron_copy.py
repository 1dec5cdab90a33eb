"""The Megatron engine's own model on the rollout side: a TP=PP=1 copy the weight sync feeds.

Colocated, the Megatron engine generates with the actor's model chunks and nothing is sent to
it. With split placement (and so in every asynchronous mode) the rollout host lives in a process
of its own, the rollout actor, which holds no actor rank: there the engine generates with a
:class:`MegatronCopy`, one ``GPTModel`` built from the same spec and layer specs the actor
uses (:func:`megarl.models.megatron_gpt.build_gpt_model`), at TP=PP=EP=1, in the run's dtype,
with the actor's LoRA adapters when it has them. Its decode loop, KV cache, sampling contract,
interrupts and resumption are the engine's own, unchanged.

Parallel state: Megatron's is per process. The rollout actor's process has no trainer world,
so the copy opens a private world of one (gloo, an in-memory rendezvous: no port, nothing the
trainer's ranks could join) and Megatron's groups at TP=PP=1 in it. A process that already has
a world of one at TP=PP=1 (a test's) is reused; any other world is refused, since the copy's
forward would run its collectives there.

Weights arrive from the exporter in Megatron layout (``megatron_layout``:
:func:`megarl.models.mapping.to_mcore_full`): each parameter whole, under its Megatron name, the
vocabulary matrices with their real rows only. They are copied into the parameters in place;
checksums are read back under the same names.

LoRA: the copy carries adapters of the actor's rank, alpha and targets (``B = 0`` at start, the
base model, as the actor starts), and an adapter sync writes the trainer's ``A`` and ``B`` into
them. Not merged weights: the adapter is rank x (in + out) per linear where merged weights are
the whole model, the gates already say the base stays (``sync: adapter only (engine kept
base)``), and the copy then runs the trainer's own forward, ``W x + s B A x``, not a merged
``(W + s B A) x`` whose rounding differs. The adapter comes under peft's names, as every engine
takes it (:meth:`megarl.engines.base.RolloutEngine.load_lora_adapter`), and is turned back into
Megatron's layout with the mapping tables (:func:`megarl.export.lora.adapter_from_hf`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megarl.engines.base import LoraAdapter
from megarl.export.checksum import tensor_checksum
from megarl.models.spec import TransformerSpec


class MegatronCopy:
    """A ``GPTModel`` at TP=PP=1 that the rollout side's Megatron engine generates with."""

    def __init__(self, model: Any, spec: TransformerSpec, lora: Any = None) -> None:
        """``lora``: the :class:`~megarl.models.lora.LoraSettings` its adapters were built
        with (None: no adapters)."""
        from megarl.models.megatron_gpt import iter_local_params

        self.model = model
        self.spec = spec
        self.lora = lora
        self._params: dict[str, torch.Tensor] = {}
        """The base parameters by the names the exporter sends (the mapping tables' Megatron
        names, experts by global index; with tied embeddings the output layer is the embedding:
        one parameter, one name)."""
        self._vocab: set[str] = set()
        """Those padded to Megatron's vocabulary: the exporter sends their real rows only."""
        for rule, layer, param in iter_local_params(model, spec):
            name = rule.mcore_name(layer)
            self._params[name] = param
            if rule.layout == "vocab":
                self._vocab.add(name)

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy whole Megatron parameters in by name; the number copied."""
        count = 0
        for name, tensor in named_tensors:
            self._target(name, tuple(tensor.shape)).copy_(tensor)
            count += 1
        return count

    def checksums(self, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
        """Megatron name -> checksum of what the parameter holds, read as ``dtype``, over the
        rows the exporter sends (the real vocabulary)."""
        out = {}
        for name, param in self._params.items():
            rows = self.spec.vocab_size if name in self._vocab else param.shape[0]
            out[name] = tensor_checksum(param.detach()[:rows].to(dtype))
        return out

    @torch.no_grad()
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Write a peft-named adapter into the copy's LoRA layers (built with the same rank,
        alpha and targets: the run's)."""
        from megarl.export.lora import adapter_from_hf
        from megarl.models.lora import iter_adapters

        if self.lora is None:
            raise RuntimeError("the Megatron engine's copy was built without LoRA adapters")
        expected = (self.lora.rank, float(self.lora.alpha), tuple(self._hf_targets()))
        if adapter.layout != expected:
            raise ValueError(
                f"adapter (rank, alpha, targets) {adapter.layout} differs from the copy's "
                f"{expected}"
            )
        tensors = dict(adapter.named_tensors)
        for site in iter_adapters(self.model, self.spec):
            layers = site.adapter
            a, b = adapter_from_hf(site.rule, site.layer, layers.parallel, tensors, self.spec)
            layers.lora_A.copy_(a)
            layers.lora_B.copy_(b)

    def _hf_targets(self) -> list[str]:
        from megarl.models.lora import hf_target_modules

        return hf_target_modules(self.spec, self.lora.target_modules)

    def _target(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        param = self._params.get(name)
        if param is None:
            raise ValueError(f"the Megatron engine's model has no parameter {name!r}")
        target = param[: self.spec.vocab_size] if name in self._vocab else param
        if tuple(target.shape) != shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(target.shape)}, got {shape}")
        return target


def build_megatron_copy(
    spec: TransformerSpec,
    hf_weights: Mapping[str, torch.Tensor] | Any,
    dtype: torch.dtype,
    device: str,
    lora: Any = None,
) -> MegatronCopy:
    """The copy in this process's private world of one (opened here when there is none),
    loaded from ``hf_weights`` (the run's starting weights), with adapters when ``lora``."""
    from megarl.models.megatron_gpt import build_gpt_model, load_hf_weights

    open_private_world(device)
    model = build_gpt_model(spec, 1, 1, dtype, device)
    load_hf_weights(model, spec, hf_weights)
    if lora is not None:
        from megarl.models.lora import apply_lora

        apply_lora(model, spec, lora)
    model.eval()
    model.requires_grad_(False)
    return MegatronCopy(model, spec, lora)


def open_private_world(device: str) -> None:
    """Megatron's parallel state at TP=PP=EP=1 over a world of this process alone (see the
    module docstring); the CPU shims on for the process's life on ``cpu``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megarl.distributed import parallel

    if device == "cpu":
        from megarl.distributed.platform import enter_cpu_shims, shims_active

        if not shims_active():
            enter_cpu_shims()
    if dist.is_initialized():
        sizes = (
            dist.get_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if sizes != (1, 1, 1):
            raise RuntimeError(
                "the Megatron engine's rollout-side copy needs a process of its own: this one "
                f"is in a world of {sizes[0]} (TP={sizes[1]}, PP={sizes[2]})"
            )
        return
    parallel.init_process_group(device, 0, 1, "127.0.0.1", 0)
    parallel.init_model_parallel(1, 1)

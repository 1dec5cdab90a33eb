"""megarl's methods inside vLLM's model workers (``worker_extension_cls``).

Runs in the process that holds vLLM's model, never in a trainer rank. It may import torch,
vLLM and the pure transport/checksum helpers, nothing else of megarl. The rollout host
(:mod:`megarl.engines.vllm`) calls these methods by name through ``LLM.collective_rpc``; their
arguments and results are plain msgpack data (tensors travel through
:mod:`megarl.engines.tensor_transport`).

Two ways a bucket is loaded (the host picks one for the engine's life):

* ``load_weights``: the model's own loaders copy each tensor into the live parameter, and on
  CPU the GEMM kernels of the layers it wrote to are packed again from them
  (:func:`repack_cpu_kernels`; the tied output layer's too). Nothing is rebuilt, so it needs
  the parameters: on CUDA they are the kernels' own; on CPU vLLM's own worker drops them once
  packed, so the engine runs :class:`megarl.engines.vllm_cpu_worker.PlainWeightsCPUWorker`,
  which keeps them.
* ``reload``: ``model_runner.reload_weights`` rebuilds each layer on the meta device, loads it
  with the checkpoint loaders and runs the layer's post-load processing (the repack) again;
  works on every backend. Two facts about it shape the host side:

  * a layer is processed once all of its parameters arrived *within one call*; a fused
    ``qkv_proj``/``gate_up_proj`` whose parts arrive in different calls is processed
    half-loaded (the rest uninitialised memory), so the host never splits a fused group across
    calls;
  * with tied embeddings ``lm_head`` shares the embedding's parameter but keeps a packed copy of
    its own, which a reload of the embedding does not refresh: :meth:`megarl_reload` repacks it.

Checksums, when asked: after an in-place load every loaded parameter is read back from the live
model (what the kernels read); on the reload path the repacked weights cannot be read back, so
each parameter is checksummed at the moment its layer is processed -- what the kernels were
built from. Fused parameters are split back into their Hugging Face parts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.engines.tensor_transport import TensorMeta, read_tensors
from megarl.export.checksum import tensor_checksum

RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)
"""A reload of a subset of layers warns about every layer it did not touch; that is the
intended use here (one bucket at a time), so those two loggers are kept to errors."""


class WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``)."""

    model_runner: Any
    """vLLM's model runner, set by the worker class this is mixed into."""

    def megarl_model_facts(self) -> dict[str, Any]:
        """What the host needs to bucket and name weights for this model."""
        model = self.model_runner.get_model()
        packed = _packed_modules(model)
        experts = _routed_experts(model)
        if experts:
            # a layer's experts are one fused group: all 3 x E checkpoint tensors in one call
            packed[ROUTED_EXPERTS] = _expert_parts(next(iter(experts.values())))
        return {
            "packed_modules_mapping": packed,
            "tied_embeddings": _tied_output_layer(model) is not None,
            "weightless_linear_layers": _weightless_linear_layers(model),
        }

    def megarl_reload(
        self,
        path: str,
        records: Sequence[Sequence],
        checksum_dtype: str | None,
        method: str = "reload",
    ) -> dict[str, list[int]]:
        """Load one bucket of HF-named tensors from the shared file; checksums if asked.

        ``method="load_weights"`` copies into the live parameters with the model's loaders (see
        the module's docstring for where that works) and ``reload`` rebuilds the layers.
        """
        metas = [TensorMeta.from_wire(r) for r in records]
        model = self.model_runner.get_model()
        loaded = {m.name for m in metas}
        if method == "load_weights":
            model.load_weights(read_tensors(path, metas))
            repack_cpu_kernels(model, loaded)
            if not checksum_dtype:
                return {}
            return _ChecksumRecorder(model, getattr(torch, checksum_dtype), loaded).read_back()
        for name in RELOAD_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        recorder = (
            _ChecksumRecorder(model, getattr(torch, checksum_dtype), loaded)
            if checksum_dtype
            else None
        )
        with recorder or contextlib.nullcontext():
            self.model_runner.reload_weights(weights_iterator=read_tensors(path, metas))
        tied = _tied_output_layer(model)
        if tied is not None and any(m.name.endswith("embed_tokens.weight") for m in metas):
            tied.quant_method.process_weights_after_loading(tied)
        return recorder.checksums if recorder else {}

    def megarl_scale_weight(self, name: str, factor: float) -> None:
        """Multiply the live parameter ``name`` (a vLLM name: the HF one for unfused, unpacked
        tensors such as norms) in place: the test hook for a corrupted engine."""
        params = dict(self.model_runner.get_model().named_parameters())
        if name not in params:
            raise KeyError(f"the engine's model has no parameter {name!r}")
        with torch.no_grad():
            params[name].mul_(factor)


ROUTED_EXPERTS = "routed_experts"
"""vLLM's module holding a mixture-of-experts layer's stacked expert weights (``w13_weight``
``[E, 2F, H]``: each expert's gate rows then its up rows; ``w2_weight`` ``[E, H, F]``), under
the checkpoint's ``...experts`` module."""


def _routed_experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if name.endswith("." + ROUTED_EXPERTS) and hasattr(module, "w13_weight")
    }


def _expert_parts(layer: Any) -> list[str]:
    """``{e}.{projection}`` for every expert, with the checkpoint's projection names (``layer``
    is vLLM's ``RoutedExperts``, whose weights and names are set at run time)."""
    names = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    return [f"{e}.{name}" for e in range(layer.w13_weight.shape[0]) for name in names]


def _packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """vLLM's fused modules and their checkpoint parts (``qkv_proj`` -> q/k/v projections)."""
    return {
        fused: list(parts) for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
    }


def _weightless_linear_layers(model: torch.nn.Module) -> int:
    """How many layers multiply with a CPU kernel packed from a weight they no longer hold
    (vLLM's CPU backend sets ``cpu_linear`` on every linear layer, and its own worker drops the
    weight). An in-place load cannot reach those."""
    return sum(
        1
        for module in model.modules()
        if getattr(module, "cpu_linear", None) is not None
        and not getattr(module, "weight", torch.empty(0)).numel()
    )


def _checkpoint_modules(module_name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The checkpoint's module names that vLLM's module ``module_name`` holds: the parts of a
    fused layer (``...qkv_proj`` -> ``...q_proj``, ``...k_proj``, ``...v_proj``), in the
    order their rows are stacked, or the module's own name."""
    prefix, _, leaf = module_name.rpartition(".")
    return [f"{prefix}.{part}" for part in packed.get(leaf, ())] or [module_name]


def repack_cpu_kernels(model: torch.nn.Module, loaded: set[str]) -> int:
    """Build again the CPU GEMM kernel of every layer an in-place load wrote to; returns how
    many. vLLM's CPU backend multiplies with a kernel packed from the weight when it was
    loaded, which a copy into the weight does not reach. Linear layers and the output layer
    have such kernels (the input embedding has one too, never used: it looks rows up);
    backends without them (CUDA) have nothing to repack."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    packed = _packed_modules(model)
    tied = _tied_output_layer(model)
    repacked = 0
    for module_name, module in model.named_modules():
        kernel = getattr(module, "cpu_linear", None)
        if kernel is None or kernel is torch.nn.functional.linear:
            continue  # no kernel of its own: torch's linear reads the weight at every call
        if module is tied:
            parts = [name for name in loaded if name.endswith("embed_tokens.weight")]
        elif isinstance(module, (LinearBase, ParallelLMHead)):
            names = _checkpoint_modules(module_name.replace(".base_layer", ""), packed)
            parts = [f"{name}.weight" for name in names if f"{name}.weight" in loaded]
        else:
            continue
        if parts:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


def _tied_output_layer(model: torch.nn.Module) -> Any:
    """The output layer when it shares the input embedding's parameter, else None.

    Typed ``Any``: it is vLLM's layer, whose ``quant_method`` torch's ``Module`` does not know.

    With LoRA enabled vLLM wraps both layers; the parameters live on their ``base_layer``.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head, embed = getattr(head, "base_layer", head), getattr(embed, "base_layer", embed)
    if head is None or embed is None or getattr(head, "weight", None) is None:
        return None
    return head if head.weight is embed.weight else None


class _ChecksumRecorder:
    """Checksum each layer's parameters just before its post-load processing (the CPU repack).

    Every ``quant_method.process_weights_after_loading`` is wrapped for the duration of one
    reload; parameters of layers without one (norms) are read after the reload, since nothing
    repacks them. After an in-place load, where the weights stay, :meth:`read_back` reads every
    loaded parameter from the live model instead. Fused parameters are split by the layer's
    ``output_sizes`` into their HF parts; only the names of the bucket are recorded.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, loaded: set[str]) -> None:
        self.model, self.dtype, self.loaded = model, dtype, loaded
        # LoRA wraps a layer as ``<name>.base_layer``; its weights keep the layer's own name
        self.module_names = {
            id(module): name.replace(".base_layer", "") for name, module in model.named_modules()
        }
        self.packed = _packed_modules(model)
        self.checksums: dict[str, list[int]] = {}
        self._methods: list[Any] = []

    def __enter__(self) -> _ChecksumRecorder:
        quant_methods = (getattr(m, "quant_method", None) for m in self.model.modules())
        methods: dict[int, Any] = {
            id(q): q for q in quant_methods if hasattr(q, "process_weights_after_loading")
        }
        for method in methods.values():
            original = method.process_weights_after_loading

            def recording(layer: torch.nn.Module, _original=original) -> None:
                self._record(layer)
                return _original(layer)

            method.process_weights_after_loading = recording
            self._methods.append(method)
        return self

    def __exit__(self, *exc: object) -> bool:
        for method in self._methods:
            vars(method).pop("process_weights_after_loading", None)
        for name, param in self.model.named_parameters():
            name = name.replace(".base_layer", "")
            if name in self.loaded and name not in self.checksums:
                self.checksums[name] = list(tensor_checksum(param.detach().to(self.dtype)))
        return False

    def read_back(self) -> dict[str, list[int]]:
        """After an in-place load: the loaded parameters as the live model holds them."""
        for module in self.model.modules():
            self._record(module)
        return self.checksums

    def _record(self, layer: torch.nn.Module) -> None:
        module_name = self.module_names.get(id(layer))
        if module_name is None:
            return
        prefix, _, leaf = module_name.rpartition(".")
        if leaf == ROUTED_EXPERTS and hasattr(layer, "w13_weight"):
            self._record_experts(prefix, layer)
            return
        sizes = getattr(layer, "output_sizes", None)
        for param_name, param in layer.named_parameters(recurse=False):
            tensor = param.detach()
            if leaf in self.packed and sizes and tensor.shape[0] == sum(sizes):
                parts = _checkpoint_modules(module_name, self.packed)
                for part, piece in zip(parts, torch.split(tensor, list(sizes)), strict=True):
                    name = f"{part}.{param_name}"
                    if name in self.loaded:
                        self.checksums[name] = list(tensor_checksum(piece.to(self.dtype)))
            elif tensor.numel() and f"{module_name}.{param_name}" in self.loaded:
                self.checksums[f"{module_name}.{param_name}"] = list(
                    tensor_checksum(tensor.to(self.dtype))
                )

    def _record_experts(self, prefix: str, layer: Any) -> None:
        """Per-expert checkpoint tensors out of the stacked ``w13_weight`` / ``w2_weight``."""
        w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
        ffn = w2.shape[-1]
        gate, up, down = (
            layer.ckpt_gate_proj_name,
            layer.ckpt_up_proj_name,
            layer.ckpt_down_proj_name,
        )
        for e in range(w13.shape[0]):
            for name, piece in ((gate, w13[e, :ffn]), (up, w13[e, ffn:]), (down, w2[e])):
                self.checksums[f"{prefix}.{e}.{name}.weight"] = list(
                    tensor_checksum(piece.to(self.dtype))
                )

"""vLLM's CPU worker that keeps its linear layers' weights beside their packed kernels
(``worker_cls``).

Runs only where vLLM holds its model on the CPU backend (the engine-core process at one rank,
vLLM's worker processes at several); the rollout host names it by its path
(:mod:`megarl.engines.vllm_settings`), never imports it.

Why: after loading, vLLM's CPU backend hands every linear layer's weight to a packed GEMM kernel
(oneDNN) and drops the plain tensor, so a weight sync has to rebuild each layer with the
checkpoint loaders and pack it again (``reload_weights``): 0.5-0.9 s for SmolLM2-135M. This
worker keeps the plain weights (the packed kernel is built from them as before, so generation
is unchanged, bit for bit), and a sync becomes the model's own ``load_weights`` -- an in-place
copy -- followed by packing again only the layers it touched
(:func:`megarl.engines.vllm_worker.repack_cpu_kernels`). The cost is memory: the linear
weights are held twice (plain and packed), as vLLM already does for the output layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from vllm.model_executor.layers import utils as layer_utils
from vllm.v1.worker.cpu_worker import CPUWorker


@contextlib.contextmanager
def weights_kept() -> Iterator[None]:
    """While open, vLLM's CPU GEMM dispatch builds its kernels as usual but never drops a
    layer's plain weight.

    vLLM's linear and embedding layers import the dispatch function from its module at each
    call, so replacing the module's attribute reaches both.
    """
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


class PlainWeightsCPUWorker(CPUWorker):
    """vLLM's CPU worker, its model loaded under :func:`weights_kept`."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        with weights_kept():
            super().load_model(*args, **kwargs)

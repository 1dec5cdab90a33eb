"""The known, harmless third-party warnings of a run, hidden in every process that imports them.

Megatron-Core warns on import that Transformer Engine and Apex are missing and that it falls
back to Torch's optimizers and norms (always true on CPU), about its own default for CUDA graphs,
and on CPU about a CUDA setting: nothing a user can act on. Each such warning is listed in
:data:`KNOWN_WARNINGS` by its message, category and the module that issues it; anything else
(the user's own warnings, a third party's unknown one) still shows.

The list is installed (:func:`install`) in every process of a run, before it imports the
libraries that warn:

- the launcher, when it imports :mod:`megarl.distributed.launcher` and as it launches (a world
  of one runs there), and spawned ranks, which unpickle their entry point from that module
  before anything else;
- the fork server, a fresh interpreter that does not inherit the launcher's filters: this module
  is the first of its preload (:data:`megarl.distributed.launcher.WARM_MODULES`) and installs the
  list when imported, so the server and every rank forked from it have it;
- Ray actors (ranks and the rollout actor), in their constructors;
- each rank again when it starts (:func:`megarl.trainer.rank_loop.run_rank`), with the CPU-only
  entries where it trains on CPU.

:func:`hf_progress_bars_off` silences transformers' own progress bars for the duration of a
block: the run's console has its own display, and "Writing model shards" (materialising a
random-init model) or "Loading weights" (the HF rollout engine) between its lines is noise.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    """One warning to hide: ``message`` matches its text from the start, ``module`` the name of
    the module that issues it (both regular expressions, as :func:`warnings.filterwarnings`)."""

    message: str
    category: type[Warning]
    module: str
    why: str
    cpu_only: bool = False
    """Hidden only in a rank that trains on CPU: on a GPU it is advice worth reading."""


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(
        r"Transformer Engine and Apex are not installed\. Falling back to ",
        UserWarning,
        r"megatron",
        "on import: Megatron-Core's optimizers, grad clipping and FSDP use Torch's; always on CPU",
    ),
    KnownWarning(
        r"Apex is not installed\. Falling back to Torch Norm",
        UserWarning,
        r"megatron",
        "on import: Megatron-Core's layer specs use Torch's norms; always on CPU",
    ),
    KnownWarning(
        r"full scope is deprecated\. Use empty cuda_graph_scope",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        "every TransformerConfig: Megatron-Core's own default (cuda_graph_scope='full') warns",
    ),
    KnownWarning(
        r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.core\.tensor_parallel",
        "first backward with tp > 1: a CUDA setting, meaningless on CPU",
        cpu_only=True,
    ),
    KnownWarning(
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"megatron\.core\.optimizer|megarl\.distributed\.platform",
        "every step of Megatron's distributed fp32 optimizer: it reads .grad of its parameter "
        "shards, views of the parameters (on CPU the shims' mode makes the call, so the warning "
        "names megarl's module)",
    ),
    KnownWarning(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed",
        "Megatron's distributed optimizer and DDP call torch's older collective names",
    ),
)


def install(device: str | None = None) -> None:
    """Hide :data:`KNOWN_WARNINGS` in this process, with ``device="cpu"`` (a rank that knows it
    trains on CPU) also the CPU-only ones. Idempotent: an installed filter is replaced, not added
    twice. Also keeps Hugging Face tokenizers from warning, in each forked process, that it turns
    its parallelism off."""
    for known in KNOWN_WARNINGS:
        if known.cpu_only and device != "cpu":
            continue
        warnings.filterwarnings(
            "ignore", message=known.message, category=known.category, module=known.module
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """transformers' progress bars off for this block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


install()  # on import: the fork server's preload imports this module first

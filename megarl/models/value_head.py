"""The critic's scalar value head: a ``hidden -> 1`` linear in place of the vocabulary output layer.

PPO's value model is the policy's architecture, initialised from the same checkpoint, with the
language-model head swapped for one number per token (verl's critic, TRL's value model). The
head sits where Megatron's ``GPTModel`` calls ``output_layer`` (after the final norm), so the
model's pipeline schedule, packing and position handling are the actor's unchanged and its
"logits" are ``[B, L, 1]`` values.

The head is *replicated* on every tensor-parallel rank, not split: its input (the final norm's
output) is the full hidden vector on every TP rank, so every replica computes the same output
and the same gradient and the replicas stay equal without a collective. The grad-norm counts
it once (Megatron's ``param_is_not_tensor_parallel_duplicate`` sees no TP attribute).

It starts from a checkpoint's scalar head when ``critic.model.path`` holds one
(:mod:`megarl.critic.model_source`). Otherwise its initialisation is zero by default: the
first rollout's values are then exactly 0, and the first updates move only the head until it
has a signal to pass back into the trunk; a small ``init_std`` starts the trunk's learning at
once instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

VALUE_HEAD_PARAM = "value_weight"
"""The head's one parameter, ``[1, hidden]``; under ``output_layer.`` in the model."""


class ValueHead(torch.nn.Module):
    """``hidden -> 1`` without bias, with ``ColumnParallelLinear``'s call signature."""

    sequence_parallel = False
    """Read by ``GPTModel`` in inference mode; the critic runs without sequence parallelism."""

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        init_std: float,
        seed: int,
        loaded: Tensor | None = None,
    ):
        super().__init__()
        weight = torch.zeros(1, hidden_size, dtype=torch.float32)
        if loaded is not None:  # a checkpoint's head (critic.model.path); no draw
            weight = loaded.detach().to(torch.float32).reshape(1, hidden_size).clone()
        elif init_std > 0:  # the same draw on every rank, so TP replicas start equal
            generator = torch.Generator().manual_seed(seed)
            weight.normal_(0.0, init_std, generator=generator)
        self.value_weight = torch.nn.Parameter(weight.to(dtype))

    def forward(
        self, hidden_SBH: Tensor, weight: Tensor | None = None, runtime_gather_output=None
    ) -> tuple[Tensor, None]:
        """``[S, B, H] -> [S, B, 1]``; ``weight`` (a tied embedding) never applies to a head."""
        del runtime_gather_output
        if weight is not None:
            raise ValueError("the value head is never tied to the embedding")
        return hidden_SBH @ self.value_weight.t(), None


def attach_value_head(
    model,
    hidden_size: int,
    dtype: torch.dtype,
    init_std: float,
    seed: int,
    loaded: Tensor | None = None,
):
    """Replace the model's ``output_layer`` (last pipeline stage only) with a
    :class:`ValueHead`: ``loaded`` when given, else zero or a draw of ``init_std``."""
    if getattr(model, "post_process", False):
        model.output_layer = ValueHead(hidden_size, dtype, init_std, seed, loaded)
    return model


def is_value_head_param_name(name: str) -> bool:
    """True for the head's parameter under any wrapper prefix (``module.`` from DDP)."""
    return name.endswith(f"output_layer.{VALUE_HEAD_PARAM}")

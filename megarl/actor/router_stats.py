"""Is a mixture-of-experts router healthy? Tokens per expert and the load-balancing loss, per step.

By default megarl trains without an auxiliary load-balancing loss (``actor.moe_aux_loss_coef``
is 0; ``megarl.models.megatron_gpt``), so nothing in the loss keeps the router balanced: these
metrics show whether RL is collapsing it onto a few experts. :class:`RouterMonitor` hooks every router of the actor while the update
runs and counts, per layer, the tokens routed to each expert and the sum of each expert's
full-softmax probability; :func:`router_metrics` turns the counts summed over the data-parallel
ranks into the step's metrics:

- ``actor/moe_load_imbalance``: the busiest expert's tokens over the mean, worst layer (1.0 =
  perfectly even; ``num_experts / top_k`` = every token to the same experts);
- ``actor/moe_aux_loss``: the Switch-Transformer load-balancing loss without its coefficient,
  ``E / (k T^2) * sum_e P_e f_e`` with ``P_e`` the summed probabilities and ``f_e`` the tokens
  routed to expert ``e`` (Megatron's ``switch_load_balancing_loss_func``), averaged over layers:
  1.0 when balanced, what ``actor.moe_aux_loss_coef`` multiplies. Always the value without the
  coefficient, over the whole step's tokens; with the coefficient > 0 the gradient gets
  Megatron's per-micro-batch version of it (``MegatronActor.router_loss_coeffs``).

Counts are taken on every training forward of the step (each optimizer step, each epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import torch

from megarl.algo.router_replay import stage_layers


def router_metrics(
    tokens_per_expert_LE: torch.Tensor, prob_sums_LE: torch.Tensor, top_k: int
) -> dict[str, float]:
    """The step's router metrics from per-layer counts (already summed over ranks).

    ``tokens_per_expert_LE[l, e]``: routing slots of layer ``l`` that went to expert ``e``
    (``top_k`` per token); ``prob_sums_LE[l, e]``: expert ``e``'s softmax probability summed
    over layer ``l``'s tokens. Layers that saw no token are left out.
    """
    counts, probs = tokens_per_expert_LE.double(), prob_sums_LE.double()
    slots = counts.sum(dim=1)
    seen = slots > 0
    if not bool(seen.any()):
        return {}
    counts, probs, slots = counts[seen], probs[seen], slots[seen]
    num_experts = counts.shape[1]
    tokens = slots / top_k
    imbalance = counts.max(dim=1).values / (slots / num_experts)
    aux = num_experts / (top_k * tokens * tokens) * (probs * counts).sum(dim=1)
    return {
        "actor/moe_load_imbalance": float(imbalance.max()),
        "actor/moe_aux_loss": float(aux.mean()),
    }


def find_routers(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every router of ``modules`` (model chunks), in model order: Megatron's MoE layer keeps its
    ``TopKRouter`` at ``...mlp.router``."""
    return [
        module
        for chunk in modules
        for name, module in chunk.named_modules()
        if name.endswith("mlp.router")
    ]


def router_layers(routers: Sequence[torch.nn.Module]) -> range:
    """The model layers (0-based) that ``routers`` sit in, from Megatron's global
    ``layer_number`` of each: under pipeline parallelism one stage's consecutive slice."""
    numbers = [router.layer_number for router in routers]
    if not all(isinstance(n, int) for n in numbers):
        raise TypeError(f"routers without a layer number: {numbers}")
    return stage_layers(cast("list[int]", numbers))


class RouterMonitor:
    """Counts, while :meth:`watch` is active, what every router of ``modules`` decides.

    ``modules``: the actor's model chunks, whose routers :func:`find_routers` finds; the hooks
    only read.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], num_experts: int, top_k: int) -> None:
        self.routers = find_routers(modules)
        self.layers = router_layers(self.routers)
        """The model layers this rank's routers sit in (one pipeline stage's)."""
        self.top_k = top_k
        layers = len(self.routers)
        self.tokens_per_expert = torch.zeros(layers, num_experts, dtype=torch.float64)
        self.prob_sums = torch.zeros(layers, num_experts, dtype=torch.float64)

    @contextmanager
    def watch(self) -> Iterator[RouterMonitor]:
        """Start from zero and count until the block ends."""
        self.tokens_per_expert.zero_()
        self.prob_sums.zero_()
        handles = [
            router.register_forward_hook(self._hook_for(layer))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook_for(self, layer: int):
        def hook(router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
            _probs, routing_map = output
            weight = router.weight
            assert isinstance(weight, torch.Tensor)
            with torch.no_grad():
                hidden = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
                logits = torch.nn.functional.linear(hidden, weight.detach().float())
                self.prob_sums[layer] += torch.softmax(logits, dim=-1).sum(dim=0).double().cpu()
                self.tokens_per_expert[layer] += routing_map.sum(dim=0).double().cpu()

        return hook

    def local_counts(self) -> torch.Tensor:
        """``[2, layers, experts]``: tokens per expert and probability sums of this rank's
        routers only."""
        return torch.stack([self.tokens_per_expert, self.prob_sums])

    def model_counts(self, num_layers: int) -> torch.Tensor:
        """``[2, num_layers, experts]``: :meth:`local_counts` at their model layers, zeros in the
        other pipeline stages' layers; the sum over every rank is what :func:`router_metrics`
        takes."""
        local = self.local_counts()
        counts = local.new_zeros(2, num_layers, local.shape[2])
        counts[:, self.layers.start : self.layers.stop] = local
        return counts

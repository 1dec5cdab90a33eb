"""Do the rollout engine and the trainer send the same tokens to the same experts?

A mixture-of-experts router picks ``top_k`` experts per token and layer. The engine and the
trainer run the same weights with different kernels (KV-cache decoding vs one full forward,
another attention, another summation order), so their router logits differ by rounding; where
two experts are nearly tied at the k-th place, rounding can flip the choice, and the token then
passes through other weights on the two sides. ``rollout/logprob_abs_diff`` shows that only as a
small mean; this module counts it directly:

- ``rollout/moe_routing_mismatch``: the fraction of (response token, layer) pairs whose top-k
  expert *set* differs between the engine and the trainer;
- ``rollout/moe_routing_mismatch_tokens``: the fraction of response tokens with a differing set
  in at least one layer.

Sets, not lists: the order of the k experts only orders the weighted sum, so ``{3, 1}`` and
``{1, 3}`` route alike. Ties are not special-cased: each side reports the experts it actually
used, and a tie broken differently on the two sides is a real difference in computation (what
routing replay would remove), so it counts.

Which positions: response token ``j`` of a sequence with prompt length ``P`` is scored by the
forward at position ``P - 1 + j`` (see :mod:`megarl.batch`), so its routing is that position's:
the last prompt token's for ``j = 0``, the previous response token's after that. That is the
routing of the very forward that produced the token's logprob on either side; the last response
token is never fed through the model and has no routing of its own.

Counts are sums, merged over data-parallel ranks before any division, so the fractions are
token-weighted over the whole step, not means of per-rank means. Under pipeline parallelism
each stage compares its own layers (:class:`StageRouting`); the pair counts add up over the
stages, a token's "differs somewhere" flags are merged by logical or.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo.summable import SummableStats

MISMATCH_METRIC = "rollout/moe_routing_mismatch"
MISMATCH_TOKENS_METRIC = "rollout/moe_routing_mismatch_tokens"


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds every expert id: what crosses processes per
    (token, layer, k) slot, so a rollout's routing costs ``layers x k`` bytes per token."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit an int16 expert id")


def expert_ids_from_routing_map(routing_map_TE: Tensor, top_k: int) -> Tensor:
    """``[T, E]`` token-to-expert mask (Megatron's ``routing_map``) -> ``[T, top_k]`` expert ids,
    ascending. Every row must select exactly ``top_k`` experts: a dropped slot (capacity
    factor) would make the set something other than the router's top-k."""
    selected_TE = routing_map_TE.bool()
    per_token = selected_TE.sum(dim=1)
    if bool((per_token != top_k).any()):
        raise ValueError(
            f"routing map selects {sorted(set(per_token.tolist()))} experts per token, "
            f"expected exactly {top_k}"
        )
    order_TE = torch.argsort(selected_TE.to(torch.uint8), dim=1, descending=True, stable=True)
    ids_TK = order_TE[:, :top_k].sort(dim=1).values
    return ids_TK.to(expert_id_dtype(routing_map_TE.shape[1]))


@dataclass(frozen=True)
class RoutingMismatch(SummableStats):
    """Counts of compared routing, summable across micro-batches and ranks (one
    :meth:`~megarl.algo.summable.SummableStats.to_row` per rank)."""

    pairs: float = 0.0
    """(response token, layer) pairs compared."""
    mismatched_pairs: float = 0.0
    """Pairs whose top-k expert sets differ."""
    tokens: float = 0.0
    """Response tokens compared."""
    mismatched_tokens: float = 0.0
    """Tokens with a differing set in at least one layer."""

    def metrics(self) -> dict[str, float]:
        """The step's ``rollout/moe_routing_mismatch*``; empty when nothing was compared (a
        dense model, an engine that does not report routing, a step that trained nothing)."""
        if self.pairs <= 0:
            return {}
        return {
            MISMATCH_METRIC: self.mismatched_pairs / self.pairs,
            MISMATCH_TOKENS_METRIC: self.mismatched_tokens / self.tokens,
        }


@dataclass(frozen=True)
class StageRouting:
    """One pipeline stage's comparison, over its own layers: the (token, layer) pair counts,
    which add up over stages, and per compared response token whether any of its layers
    differs, which the stages merge by logical or (:meth:`counts` after an element-wise
    maximum over the pipeline group) so that a token counts once, whichever stage saw it."""

    pairs: float
    mismatched_pairs: float
    differs_T: Tensor
    """``[tokens]`` bool, the compared response tokens of every sequence, in ascending sequence
    index: the same order on every stage, which runs the same sequences."""

    def counts(self, differs_T: Tensor | None = None, count_tokens: bool = True) -> RoutingMismatch:
        """This stage's :class:`RoutingMismatch`. ``differs_T``: the flags merged over the
        pipeline stages (this stage's own by default, at PP = 1); ``count_tokens`` on one stage
        only, so that the tokens are not counted once per stage."""
        flags = self.differs_T if differs_T is None else differs_T
        return RoutingMismatch(
            pairs=self.pairs,
            mismatched_pairs=self.mismatched_pairs,
            tokens=float(flags.numel()) if count_tokens else 0.0,
            mismatched_tokens=float(flags.sum()) if count_tokens else 0.0,
        )


def compare_routing(engine_BTLK: Tensor, trainer_BTLK: Tensor, mask_BT: Tensor) -> StageRouting:
    """Compare expert sets per (token, layer) where ``mask_BT`` is set.

    ``[B, T, layers, k]`` expert ids on both sides, each (token, layer)'s k ids in any order;
    ``mask_BT`` marks the real response tokens (padding is never counted).
    """
    if engine_BTLK.shape != trainer_BTLK.shape:
        raise ValueError(
            f"engine routing {tuple(engine_BTLK.shape)} vs trainer {tuple(trainer_BTLK.shape)}"
        )
    engine_sets = engine_BTLK.long().sort(dim=-1).values
    trainer_sets = trainer_BTLK.long().sort(dim=-1).values
    differs_BTL = (engine_sets != trainer_sets).any(dim=-1)
    valid_BT = mask_BT.bool()
    differs_BTL = differs_BTL & valid_BT.unsqueeze(-1)
    num_layers = engine_BTLK.shape[2]
    return StageRouting(
        pairs=float(valid_BT.sum()) * num_layers,
        mismatched_pairs=float(differs_BTL.sum()),
        differs_T=differs_BTL.any(dim=-1)[valid_BT],
    )


def routing_mismatch_of_sequences(
    trainer: Mapping[int, Tensor], engine: Mapping[int, Tensor]
) -> StageRouting:
    """:func:`compare_routing` of every sequence in both maps (``{index: [R, layers, k]}``): the
    trainer's captured routing against the engine's of the same response tokens and layers."""
    keys = sorted(set(trainer) & set(engine))
    if not keys:
        return StageRouting(0.0, 0.0, torch.zeros(0, dtype=torch.bool))
    for i in keys:
        if trainer[i].shape != engine[i].shape:
            raise ValueError(
                f"sequence {i}: trainer routing {tuple(trainer[i].shape)} vs engine "
                f"{tuple(engine[i].shape)}"
            )
    pad = torch.nn.utils.rnn.pad_sequence
    engine_BTLK = pad([engine[i].long() for i in keys], batch_first=True)
    trainer_BTLK = pad([trainer[i].long() for i in keys], batch_first=True)
    mask_BT = pad([torch.ones(len(engine[i]), dtype=torch.bool) for i in keys], batch_first=True)
    return compare_routing(engine_BTLK, trainer_BTLK, mask_BT)

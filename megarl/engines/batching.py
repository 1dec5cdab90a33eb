"""How an engine that owns its decode loop batches one call: one prefill per distinct context,
left-padded.

GRPO asks for ``n`` samples of each prompt. Their contexts (the prompt, then any tokens of an
earlier call) are equal, so the prefill, most of a short rollout's compute, runs on the distinct
ones only (:class:`DistinctContexts`); the engine then copies the cache and logits rows out to
one per request, and each row samples from its own seeds. The distinct contexts are left-padded
(:func:`left_pad`) so that every row's next token sits in the last column. When several
data-parallel replicas generate one call together, :func:`shard_requests` deals its requests
out, keeping each context's requests on one replica.

Nothing here knows a model: it sees token ids and builds index lists and tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megarl.engines.base import Request, SamplingParams


@dataclass(frozen=True)
class DistinctContexts:
    """A call's requests as the rows of one prefill, each distinct context once."""

    contexts: tuple[tuple[int, ...], ...]
    """The distinct contexts, in the order the requests first name them: the prefill's rows."""
    rows: tuple[int, ...]
    """Each request's row of the prefill, in request order."""

    @classmethod
    def of(cls, requests: Sequence[Request]) -> DistinctContexts:
        keys = [request.context_ids for request in requests]
        contexts = tuple(dict.fromkeys(keys))
        slot = {context: row for row, context in enumerate(contexts)}
        return cls(contexts, tuple(slot[key] for key in keys))

    @property
    def shared(self) -> bool:
        """Whether some requests share a row (the prefill's rows must then be copied out)."""
        return len(self.contexts) < len(self.rows)


def shard_requests(
    requests: Sequence[Request], params: SamplingParams, num_shards: int
) -> tuple[tuple[int, ...], ...]:
    """The request indices each of ``num_shards`` replicas generates, in request order.

    The requests of one context (a GRPO group) stay together, so that they share one prefill.
    Contexts are dealt out largest first to the replica with the least work so far (the
    longest-processing-time rule; ties to the lower replica, so every rank computes the same
    plan). A context's work is the token positions its requests may fill at most: per request,
    the context and the budget left.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    by_context: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        by_context.setdefault(request.context_ids, []).append(index)
    work = {
        context: sum(len(context) + requests[i].budget(params) for i in indices)
        for context, indices in by_context.items()
    }
    load = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for context in sorted(by_context, key=lambda c: -work[c]):  # stable: first-named first
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        load[shard] += work[context]
        shards[shard] += by_context[context]
    return tuple(tuple(sorted(indices)) for indices in shards)


@dataclass(frozen=True)
class PaddedBatch:
    """Left-padded prompts with what the model needs to ignore the padding."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    position_ids_BT: torch.Tensor


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> PaddedBatch:
    """Left-pad so every row's last prompt token is in the last column.

    Real tokens get positions 0..len-1 (as if unpadded); pad positions get 1, a harmless
    placeholder since they are masked out (the same convention as ``transformers``).
    """
    max_len = max(len(p) for p in prompts)
    input_ids_BT = torch.full((len(prompts), max_len), pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids_BT[row, max_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask_BT[row, max_len - len(prompt) :] = 1
    position_ids_BT = (attention_mask_BT.cumsum(dim=1) - 1).masked_fill(attention_mask_BT == 0, 1)
    return PaddedBatch(
        input_ids_BT.to(device), attention_mask_BT.to(device), position_ids_BT.to(device)
    )

"""Target-layout resharding: each vLLM tensor-parallel rank's shard, straight from Megatron shards.

Pure tensor code (no torch.distributed). vLLM slices HF tensors inside its parallel layers when it
loads them; this module computes the same per-rank slices from the Megatron TP shards, reading
only the Megatron shards that overlap (:func:`needed_mcore_ranks`). When Megatron's TP equals the
engine's TP, engine rank ``r`` needs exactly Megatron rank ``r``'s shard: no gather at all (the
vocabulary too when it is a multiple of 128 x TP, so that both pad it alike; otherwise the
differently padded vocabulary rows straddle a neighbouring shard).

vLLM's layouts, per engine rank ``r`` of ``tp`` (from vLLM's ``linear.py`` and
``vocab_parallel_embedding.py``):

- ``QKVParallelLinear``: ``[q_r; k_r; v_r]``. ``q_r`` = query heads ``[r*H/tp, (r+1)*H/tp)``.
  With ``tp <= G`` KV heads, ``k_r``/``v_r`` = KV heads ``[r*G/tp, (r+1)*G/tp)``; with ``tp > G``
  one KV head, ``r // (tp/G)``, replicated over ``tp/G`` ranks. Bias sliced the same way.
- ``MergedColumnParallelLinear`` (gate/up): ``[gate_r; up_r]``, rows ``[r*F/tp, (r+1)*F/tp)``.
- ``RowParallelLinear``: input dim (dim 1) sliced, ``[r*N/tp, (r+1)*N/tp)``.
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary padded to a multiple of 64, each
  rank holds ``padded/tp`` rows; rows past the real vocabulary are zero.
- Norms: replicated.

Megatron's layouts are described in :mod:`megarl.models.mapping` (QKV interleaved per query group,
gate/up per rank, vocabulary padded to a multiple of 128 x TP).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from megarl.models.mapping import ParamRule
from megarl.models.spec import TransformerSpec

VLLM_VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``."""


def vllm_param_name(rule: ParamRule, layer: int | None) -> str:
    """The engine-side (vLLM) parameter name: fused q/k/v and gate/up get vLLM's stacked names."""
    first = rule.hf_names(layer)[0]
    if rule.layout == "qkv":
        return first.replace(".q_proj.", ".qkv_proj.")
    if rule.layout == "gate_up":
        return first.replace(".gate_proj.", ".gate_up_proj.")
    return first


def vllm_padded_vocab(vocab_size: int, tp: int) -> int:
    padded = -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        raise ValueError(f"rollout.tp={tp} does not divide vLLM's padded vocabulary ({padded})")
    return padded


def _kv_heads_of(spec: TransformerSpec, tp: int, rank: int) -> tuple[int, int]:
    """KV head range ``[lo, hi)`` engine rank ``rank`` holds (one replicated head if tp > G)."""
    groups = spec.num_kv_heads
    if tp >= groups:
        if tp % groups:
            raise ValueError(f"rollout.tp={tp} is not a multiple of {groups} KV heads")
        head = rank // (tp // groups)
        return head, head + 1
    if groups % tp:
        raise ValueError(f"rollout.tp={tp} does not divide {groups} KV heads")
    per = groups // tp
    return rank * per, (rank + 1) * per


def _q_heads_of(spec: TransformerSpec, tp: int, rank: int) -> tuple[int, int]:
    if spec.num_heads % tp:
        raise ValueError(f"rollout.tp={tp} does not divide {spec.num_heads} attention heads")
    per = spec.num_heads // tp
    return rank * per, (rank + 1) * per


# --- the reference: vLLM slicing full HF tensors ----------------------------------------------


def vllm_shard_from_hf(
    rule: ParamRule, hf_tensors: Sequence[torch.Tensor], spec: TransformerSpec, tp: int, rank: int
) -> torch.Tensor:
    """What vLLM's weight loaders put in engine rank ``rank``'s parameter, given full HF tensors."""
    layout = rule.layout
    if layout == "replicated":
        return hf_tensors[0].clone()
    if layout in ("column", "row"):
        dim = 0 if layout == "column" else 1
        size = hf_tensors[0].shape[dim] // tp
        return hf_tensors[0].narrow(dim, rank * size, size).clone()
    if layout == "gate_up":
        size = spec.ffn_hidden_size // tp
        return torch.cat([t.narrow(0, rank * size, size) for t in hf_tensors])
    if layout == "vocab":
        weight = hf_tensors[0]
        per = vllm_padded_vocab(spec.vocab_size, tp) // tp
        start, end = min(rank * per, spec.vocab_size), min((rank + 1) * per, spec.vocab_size)
        out = weight.new_zeros((per, *weight.shape[1:]))
        out[: end - start] = weight[start:end]
        return out
    q, k, v = hf_tensors
    d = spec.head_dim
    q_lo, q_hi = _q_heads_of(spec, tp, rank)
    kv_lo, kv_hi = _kv_heads_of(spec, tp, rank)
    return torch.cat([q[q_lo * d : q_hi * d], k[kv_lo * d : kv_hi * d], v[kv_lo * d : kv_hi * d]])


# --- straight from Megatron shards ------------------------------------------------------------


def _pieces_for(rows_per_piece: int, lo: int, hi: int) -> range:
    return range(lo // rows_per_piece, -(-hi // rows_per_piece))


def _rows(
    piece: Callable[[int], torch.Tensor], rows_per_piece: int, lo: int, hi: int
) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the dim-0 concatenation of equal pieces, touching only those needed."""
    parts = []
    for m in _pieces_for(rows_per_piece, lo, hi):
        base = m * rows_per_piece
        parts.append(piece(m)[max(lo, base) - base : min(hi, base + rows_per_piece) - base])
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _row_ranges(
    rule: ParamRule, spec: TransformerSpec, mcore_tp: int, tp: int, rank: int
) -> list[tuple[int, int, int]]:
    """``(rows_per_megatron_piece, lo, hi)`` intervals this engine rank reads, per HF part."""
    layout = rule.layout
    if layout == "replicated":
        return []
    if layout in ("column", "row"):
        dim = 0 if layout == "column" else 1
        n = spec_dim(rule, spec, dim)
        return [(n // mcore_tp, rank * n // tp, (rank + 1) * n // tp)]
    if layout == "gate_up":
        f = spec.ffn_hidden_size
        span = (f // mcore_tp, rank * f // tp, (rank + 1) * f // tp)
        return [span, span]
    if layout == "vocab":
        per = vllm_padded_vocab(spec.vocab_size, tp) // tp
        lo, hi = min(rank * per, spec.vocab_size), min((rank + 1) * per, spec.vocab_size)
        return [(spec.padded_vocab_size(mcore_tp) // mcore_tp, lo, max(hi, lo))]
    d, groups_per_rank = spec.head_dim, spec.num_kv_heads // mcore_tp
    q_lo, q_hi = _q_heads_of(spec, tp, rank)
    kv_lo, kv_hi = _kv_heads_of(spec, tp, rank)
    q_span = (groups_per_rank * spec.heads_per_group * d, q_lo * d, q_hi * d)
    kv_span = (groups_per_rank * d, kv_lo * d, kv_hi * d)
    return [q_span, kv_span, kv_span]


def spec_dim(rule: ParamRule, spec: TransformerSpec, dim: int) -> int:
    from megarl.models.mapping import hf_shapes

    return hf_shapes(rule, spec)[0][dim]


def needed_mcore_ranks(
    rule: ParamRule, spec: TransformerSpec, mcore_tp: int, tp: int, rank: int
) -> tuple[int, ...]:
    """Megatron TP ranks whose shards engine rank ``rank`` reads (replicated: its own peer)."""
    spans = _row_ranges(rule, spec, mcore_tp, tp, rank)
    if not spans:
        return (rank % mcore_tp,)
    needed: set[int] = set()
    for rows_per_piece, lo, hi in spans:
        needed.update(_pieces_for(rows_per_piece, lo, hi) if hi > lo else ())
    return tuple(sorted(needed)) or (rank % mcore_tp,)  # all padding: any shard gives the dtype


def _hf_parts_of_shard(
    rule: ParamRule, shard: torch.Tensor, spec: TransformerSpec
) -> tuple[torch.Tensor, ...]:
    """One Megatron shard seen as its pieces of each HF tensor (views, no copy)."""
    layout = rule.layout
    if layout in ("column", "vocab", "replicated"):
        return (shard,)
    if layout == "row":
        return (shard.transpose(0, 1),)
    if layout == "gate_up":
        return tuple(shard.chunk(2, dim=0))
    d, hpg = spec.head_dim, spec.heads_per_group
    trailing = shard.shape[1:]
    grouped = shard.reshape(-1, hpg + 2, d, *trailing)
    q = grouped[:, :hpg].reshape(-1, *trailing)
    return q, grouped[:, hpg].reshape(-1, *trailing), grouped[:, hpg + 1].reshape(-1, *trailing)


def vllm_shard_from_mcore(
    rule: ParamRule,
    mcore_shards: Mapping[int, torch.Tensor],
    spec: TransformerSpec,
    mcore_tp: int,
    tp: int,
    rank: int,
) -> torch.Tensor:
    """Engine rank ``rank``'s vLLM parameter from the Megatron shards it needs (a mapping from
    Megatron TP rank to shard; only :func:`needed_mcore_ranks` must be present)."""
    spans = _row_ranges(rule, spec, mcore_tp, tp, rank)
    if not spans:
        return mcore_shards[rank % mcore_tp].clone()

    def part(index: int) -> Callable[[int], torch.Tensor]:
        return lambda m: _hf_parts_of_shard(rule, mcore_shards[m], spec)[index]

    pieces = [
        _rows(part(i), rpp, lo, hi) if hi > lo else None for i, (rpp, lo, hi) in enumerate(spans)
    ]
    if rule.layout == "row":
        return pieces[0].transpose(0, 1).contiguous()
    if rule.layout == "vocab":
        per = vllm_padded_vocab(spec.vocab_size, tp) // tp
        out = mcore_shards[next(iter(mcore_shards))].new_zeros((per, spec.hidden_size))
        if pieces[0] is not None:
            out[: pieces[0].shape[0]] = pieces[0]
        return out
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def local_engine_shards(
    local_params, spec: TransformerSpec, mcore_tp: int, mcore_rank: int, engine_tp: int
):
    """``(vLLM name, shard)`` for engine rank ``mcore_rank``, from this Megatron rank's own shards.

    The colocated case (engine rank r on Megatron TP rank r's device, equal TP): no communication
    at all. ``local_params`` is ``(rule, layer, param)`` as the actor lists them (one pipeline
    stage). Raises ValueError naming the first parameter that would need a peer's shard, so the
    caller falls back to the gathering exporter.
    """
    if engine_tp != mcore_tp:
        raise ValueError(f"rollout.tp={engine_tp} != actor.tp={mcore_tp}: shards need peers")
    seen: set[str] = set()
    for rule, layer, param in local_params:
        name = vllm_param_name(rule, layer)
        if name in seen:
            continue  # tied output layer on the last stage: the embedding already went
        seen.add(name)
        needed = needed_mcore_ranks(rule, spec, mcore_tp, engine_tp, mcore_rank)
        if needed != (mcore_rank,):
            raise ValueError(
                f"{name} for engine rank {mcore_rank} needs Megatron TP ranks "
                f"{list(needed)} (vocabulary padded differently)"
            )
        yield (
            name,
            vllm_shard_from_mcore(
                rule, {mcore_rank: param.detach()}, spec, mcore_tp, engine_tp, mcore_rank
            ),
        )

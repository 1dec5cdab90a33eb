"""Micro-batches: which sequences each DP rank runs in one optimizer step, packed and padded.

Sharding. Within each non-ghost step the trained sequences are split over ``dp_size`` ranks by
estimated cost ``t + attention_cost_coef * t**2`` (``t`` = prompt + response tokens; see
:mod:`megarl.planner.partition`: LPT in rounds plus a swap refinement), then packed per rank into
micro-batches of at most ``micro_batch_tokens`` tokens by first-fit-decreasing. Ranks must run
the same number of micro-batches, a multiple of ``micro_batch_multiple`` (the interleaved
pipeline schedule's group size): a rank short of micro-batches first splits its fullest
multi-sequence micro-batches (no extra compute), and only then is padded with *filler*
micro-batches. A rank with no trained sequence at all gets fillers too, so no rank is ever empty
in a non-ghost step. A filler is one sequence at loss weight 0: the shortest zero-advantage
sequence of the step's mini-batch(es), else of the whole batch, else the step's shortest trained
sequence (ties by index). Fillers never count in normalisers or kept fractions.

Why this shape. The DP ranks of a step run Megatron's forward-backward schedule in lockstep
(its collectives pair up call by call), so they must run equally many micro-batches, and the
slowest rank sets the step's wall time: balance by cost, then equalise the counts as cheaply as
possible (a split is free, a filler is a real forward+backward that contributes nothing). The
generic algorithms (cost model, LPT, first-fit-decreasing, splitting) are
:mod:`megarl.planner.partition`; this module knows which sequences are trained and which may
serve as fillers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megarl.planner.inputs import BatchArrays, PlannerInputs
from megarl.planner.partition import balanced_partition, first_fit_decreasing, split_to_count
from megarl.planner.step_plan import MicroBatch, RankPlan

# Per-step reasons list at most this many padded ranks by number before summarising.
_MAX_RANKS_NAMED = 4


def plan_forward_micro_batches(
    seq_indices: Sequence[int], seq_tokens: Sequence[int], budget: int, multiple: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Micro-batches of a forward-only (logprob) pass, packed as training packs them; their
    count a multiple of ``multiple`` (split first, then the shortest micro-batch run again:
    its sequences' values come out twice, equal)."""
    bins = _pack_micro_batches(seq_indices, seq_tokens, budget)
    if not bins:
        return ()
    wanted = round_up(len(bins), multiple)
    bins = split_to_count(bins, wanted, seq_tokens)
    if len(bins) < wanted:
        shortest = min(bins, key=lambda b: sum(map(seq_tokens.__getitem__, b)))
        bins += [shortest] * (wanted - len(bins))
    return tuple(map(tuple, bins))


def round_up(count: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``count``."""
    return -(-count // multiple) * multiple


def plan_ranks(
    members: np.ndarray, trained: np.ndarray, inputs: PlannerInputs, batch: BatchArrays
) -> tuple[tuple[RankPlan, ...], tuple[float, ...], list[int]]:
    """Balance ``trained`` over ranks, pack micro-batches, equalise their counts with fillers.

    Returns the rank plans, the estimated cost per rank and the number of fillers per rank.
    """
    trained_costs = batch.costs[trained]
    parts = balanced_partition(trained_costs, inputs.dp_size)
    rank_seqs = [trained[part].tolist() for part in parts]
    rank_bins = [
        _pack_micro_batches(seqs, inputs.seq_tokens, inputs.micro_batch_tokens)
        for seqs in rank_seqs
    ]
    num_per_rank = round_up(max(len(bins) for bins in rank_bins), inputs.micro_batch_multiple)
    rank_bins = [split_to_count(bins, num_per_rank, inputs.seq_tokens) for bins in rank_bins]
    fillers_per_rank = [num_per_rank - len(bins) for bins in rank_bins]
    filler = _filler_index(members, trained, batch) if any(fillers_per_rank) else -1
    ranks = tuple(
        RankPlan(_micro_batches(bins, num_fillers, filler, inputs.seq_tokens))
        for bins, num_fillers in zip(rank_bins, fillers_per_rank, strict=True)
    )
    filler_cost = float(batch.costs[filler]) if filler >= 0 else 0.0
    rank_costs = tuple(
        float(trained_costs[part].sum()) + num_fillers * filler_cost
        for part, num_fillers in zip(parts, fillers_per_rank, strict=True)
    )
    return ranks, rank_costs, fillers_per_rank


def _pack_micro_batches(
    seq_indices: Sequence[int], seq_tokens: Sequence[int], budget: int
) -> list[list[int]]:
    """First-fit-decreasing of sequences into micro-batches of ``budget`` tokens; a sequence
    over the budget runs alone, never split."""
    bins = first_fit_decreasing([seq_tokens[i] for i in seq_indices], budget)
    return [[seq_indices[position] for position in positions] for positions in bins]


def _micro_batches(
    bins: list[list[int]], num_fillers: int, filler: int, seq_tokens: tuple[int, ...]
) -> tuple[MicroBatch, ...]:
    """One rank's micro-batches: its trained bins at loss weight 1, then its fillers at 0."""
    trained = [
        MicroBatch(
            seq_indices=tuple(sorted(seqs)),
            loss_weights=(1.0,) * len(seqs),
            num_tokens=sum(map(seq_tokens.__getitem__, seqs)),
        )
        for seqs in bins
    ]
    if num_fillers == 0:
        return tuple(trained)
    padding = MicroBatch(seq_indices=(filler,), loss_weights=(0.0,), num_tokens=seq_tokens[filler])
    return (*trained, *(padding,) * num_fillers)


def _filler_index(members: np.ndarray, trained: np.ndarray, batch: BatchArrays) -> int:
    """Shortest zero-adv sequence of the step's mini-batches, else of the batch, else trained."""
    for pool in (members, np.arange(len(batch.zero_adv))):
        zero_adv = pool[batch.zero_adv[pool]]
        if len(zero_adv):
            return _shortest(zero_adv, batch.seq_tokens)
    return _shortest(trained, batch.seq_tokens)


def _shortest(ascending_indices: np.ndarray, seq_tokens: np.ndarray) -> int:
    """The index with the fewest tokens; ``argmin`` takes the first, i.e. the lowest index."""
    return int(ascending_indices[np.argmin(seq_tokens[ascending_indices])])


def padding_reasons(label: str, fillers_per_rank: list[int]) -> list[str]:
    """The step's reasons when fillers padded some ranks: which ranks, and how many fillers."""
    padded = [(rank, count) for rank, count in enumerate(fillers_per_rank) if count]
    if not padded:
        return []
    num_fillers = sum(count for _, count in padded)
    noun = "filler" if num_fillers == 1 else "fillers"
    if len(padded) == 1:
        return [f"{label}: rank {padded[0][0]} padded with {num_fillers} {noun}"]
    if len(padded) <= _MAX_RANKS_NAMED:
        names = ", ".join(str(rank) for rank, _ in padded)
        return [f"{label}: ranks {names} padded with {num_fillers} {noun}"]
    return [f"{label}: {len(padded)} ranks padded with {num_fillers} {noun}"]

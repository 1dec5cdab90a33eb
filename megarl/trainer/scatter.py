"""Rank 0 sends each rank the part of a step's data its data-parallel rank runs.

The full batch (and anything per sequence computed from it on rank 0) stays on rank 0; every
rank holds the batch's metadata (what the planner reads) and receives only the sequences the
plan gives its DP rank, the same part for the TP/PP ranks of one DP rank, so the bytes a rank
receives stay flat as DP grows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from megarl.batch import RolloutBatch, RolloutShard
from megarl.planner.step_plan import StepPlan

if TYPE_CHECKING:
    from megarl.trainer.runtime import Runtime


def scatter_sequences(
    rt: Runtime,
    rollout: RolloutBatch | None,
    header: RolloutShard,
    plan: StepPlan,
    critic_plan: StepPlan | None = None,
) -> RolloutShard:
    """Rank 0 sends every rank the sequences its DP rank runs in ``plan`` (and in the critic's
    plan, which may split the batch differently), the same shard to the TP/PP ranks of one DP
    rank, so no rank receives the whole batch."""
    source = None if rollout is None else rollout.shard
    return header.with_sequences(scatter_by_dp_rank(rt, source, plan, critic_plan))


def scatter_by_dp_rank(rt: Runtime, part_of, *plans: StepPlan | None):
    """Rank 0 (which passes ``part_of``, a function of a sorted tuple of sequence indices)
    sends every rank the part of the sequences its DP rank runs in any of ``plans``; each DP
    rank's part is made once and shared by its TP/PP ranks. Returns this rank's part."""
    parts = None
    if part_of is not None:
        by_dp = {dp: part_of(sequences_on_rank(dp, *plans)) for dp in set(rt.rank_to_dp)}
        parts = [by_dp[dp] for dp in rt.rank_to_dp]
    received: list = [None]
    dist.scatter_object_list(received, parts, src=0)
    return received[0]


def sequences_on_rank(dp: int, *plans: StepPlan | None) -> tuple[int, ...]:
    """Every sequence DP rank ``dp`` runs in any of ``plans``, sorted."""
    return tuple(sorted({i for p in plans if p is not None for i in p.sequences_on_rank(dp)}))

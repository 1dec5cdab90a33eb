"""Outcome advantages for GRPO-style training.

Every function here is pure tensor code on a flat batch of ``B`` sequences: no process groups,
no model, no Python loop per sequence.  Sequences that were sampled from the same prompt share a
group id; the advantage of a sequence is how much better its reward is than its group's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

AdvantageEstimator = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class GroupStats:
    """Per-sequence view of the statistics of the group each sequence belongs to.

    Every field is indexed by sequence (``_B``), already gathered back from its group, so callers
    can combine them element-wise with the rewards without knowing how many groups there are.
    """

    mean_B: Tensor
    std_B: Tensor
    is_constant_B: Tensor


def _output_dtype(rewards_B: Tensor) -> torch.dtype:
    """Keep the caller's float dtype; integer rewards (e.g. 0/1 correctness) become default float."""
    return rewards_B.dtype if rewards_B.is_floating_point() else torch.get_default_dtype()


def _group_stats(rewards_B: Tensor, group_ids_B: Tensor) -> GroupStats:
    """Mean, unbiased std and "all rewards equal" flag of each sequence's group.

    Statistics are accumulated in float64 so that the mean of a non-constant group is as close to
    exact as it can be; constant groups are detected separately (min == max) because no amount of
    precision makes ``sum(x) / n == x`` hold for every float ``x``.
    """
    unique_ids_G, group_index_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = unique_ids_G.numel()
    rewards64_B = rewards_B.to(torch.float64)

    size_G = torch.bincount(group_index_B, minlength=num_groups).to(torch.float64)
    sum_G = torch.zeros(num_groups, dtype=torch.float64, device=rewards_B.device)
    sum_G.index_add_(0, group_index_B, rewards64_B)
    mean_G = sum_G / size_G

    centred_B = rewards64_B - mean_G[group_index_B]
    sq_dev_G = torch.zeros_like(sum_G).index_add_(0, group_index_B, centred_B.square())
    # Unbiased (n - 1) like torch.std; a singleton group has no spread, and is constant anyway.
    std_G = (sq_dev_G / (size_G - 1).clamp_min(1)).sqrt()

    min_G = torch.full_like(sum_G, float("inf")).scatter_reduce(
        0, group_index_B, rewards64_B, reduce="amin"
    )
    max_G = torch.full_like(sum_G, float("-inf")).scatter_reduce(
        0, group_index_B, rewards64_B, reduce="amax"
    )
    return GroupStats(
        mean_B=mean_G[group_index_B],
        std_B=std_G[group_index_B],
        is_constant_B=(min_G == max_G)[group_index_B],
    )


def group_relative_advantages(
    rewards_B: Tensor,
    group_ids_B: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome advantage of each sequence: reward minus its group mean, optionally / std.

    A group whose rewards are all equal (including a group of one) carries no learning signal, and
    its advantages are set to *exactly* 0.0 rather than whatever float rounding of the mean leaves
    behind: downstream, sequences with advantage exactly 0 are pruned from training and counted in
    ``critic/advantages/zero_adv_ratio``, so a stray 1e-9 would silently waste compute and corrupt
    that metric.

    Args:
        rewards_B: one scalar reward per sequence.
        group_ids_B: integer group id per sequence; arbitrary values, any order.
        norm_by_std: divide by (group std + eps) as in GRPO; ``False`` gives Dr.GRPO's
            mean-centred advantage, which does not up-weight low-variance (too easy/hard) groups.
        eps: keeps the division finite for near-constant groups.

    Returns:
        advantages with shape ``[B]`` and the rewards' float dtype.
    """
    if rewards_B.ndim != 1 or rewards_B.shape != group_ids_B.shape:
        raise ValueError(
            f"rewards_B and group_ids_B must both be 1-D of the same length, got "
            f"{tuple(rewards_B.shape)} and {tuple(group_ids_B.shape)}"
        )
    out_dtype = _output_dtype(rewards_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)

    stats = _group_stats(rewards_B, group_ids_B)
    adv_B = rewards_B.to(torch.float64) - stats.mean_B
    if norm_by_std:
        adv_B = adv_B / (stats.std_B + eps)
    adv_B = torch.where(stats.is_constant_B, torch.zeros_like(adv_B), adv_B)
    return adv_B.to(out_dtype)


def zero_advantage_mask(adv_B: Tensor) -> Tensor:
    """True for sequences whose advantage is exactly 0, i.e. that would not move the policy."""
    return adv_B == 0


def grpo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """GRPO: group-mean-centred and group-std-normalised."""
    return group_relative_advantages(rewards_B, group_ids_B, norm_by_std=True)


def grpo_no_std_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Dr.GRPO: group-mean-centred only, avoiding the std normalisation's difficulty bias."""
    return group_relative_advantages(rewards_B, group_ids_B, norm_by_std=False)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "grpo_no_std": grpo_no_std_advantages,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up an estimator by its config name, failing loudly with the names that do exist."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}") from None

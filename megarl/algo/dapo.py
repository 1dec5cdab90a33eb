"""DAPO's rollout-side pieces (Yu et al. 2025, arXiv:2503.14476): dynamic sampling and overlong
reward shaping. The third, token-level loss aggregation, is ``actor.loss_agg=token-mean``.

Dynamic sampling (``algo.filter_groups``): a group whose responses all scored the same has
advantage 0 everywhere, so it contributes no policy gradient and only shrinks the effective
batch. DAPO drops such groups and generates more prompts until the step has its full number of
groups with a learning signal. The decision of what to keep and when to stop is here, on plain
tensors; the rollout producer only generates and concatenates.

Overlong reward shaping (``reward.overlong_buffer``): a response that runs into the last
``len`` tokens before ``rollout.max_new_tokens`` gets a penalty growing linearly from 0 to
``-penalty_factor`` at the limit, a softer signal than scoring every truncated answer 0.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

FILTER_GROUP_METRICS: tuple[str, ...] = ("score",)
"""``algo.filter_groups.metric``: what must differ within a group. ``score`` is the reward the
estimators see (after overlong shaping). verl also offers ``acc`` and ``seq_reward``, which need
extra outputs from its reward managers that a megarl reward function does not have."""


def overlong_penalty(
    response_lens: Sequence[int], max_new_tokens: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """Per response: ``min(0, -(len - (max_new_tokens - buffer_len)) / buffer_len * factor)``.

    0 up to ``max_new_tokens - buffer_len`` tokens, then linear down to ``-penalty_factor`` for a
    response that used every allowed token (DAPO's eq. 13).
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in (0, {max_new_tokens}], got {buffer_len}")
    lens = torch.tensor(list(response_lens), dtype=torch.float32)
    expected = max_new_tokens - buffer_len
    return torch.clamp(-(lens - expected) / buffer_len * penalty_factor, max=0.0)


def groups_with_signal(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Bool per group (``0 .. max(group_ids)``): its scores are not all equal.

    Equality is exact, as for zero-advantage pruning: a group of equal scores has exactly zero
    advantage under every outcome estimator, and any difference at all gives a gradient.
    """
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    keep = torch.zeros(num_groups, dtype=torch.bool)
    for group in range(num_groups):
        members = scores[group_ids == group]
        keep[group] = bool((members != members[0]).any()) if members.numel() else False
    return keep


@dataclass(frozen=True)
class FilterDecision:
    """After one more generation batch: how many groups are kept so far, and what next."""

    kept_groups: int
    needed_groups: int
    gen_batches: int
    max_gen_batches: int
    """0 = no limit."""

    @property
    def enough(self) -> bool:
        return self.kept_groups >= self.needed_groups

    @property
    def give_up(self) -> bool:
        """Not enough, and the limit allows no further generation batch."""
        return not self.enough and 0 < self.max_gen_batches <= self.gen_batches

    def message(self, step: int) -> str:
        """The one line a run stops with when :attr:`give_up`."""
        return (
            f"algo.filter_groups: step {step} found {self.kept_groups} of "
            f"{self.needed_groups} groups with differing rewards in "
            f"algo.filter_groups.max_num_gen_batches={self.max_gen_batches} generation batches; "
            "raise max_num_gen_batches (0 = no limit), make the task's rewards vary more "
            "(rollout.n, rollout.temperature), or set algo.filter_groups.enable=false"
        )

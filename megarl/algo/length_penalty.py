"""Linear length penalties on the reward (prime-rl's ``length_penalty``, type ``linear``).

A response's reward is reduced, before the advantages, by the group's pass rate times a weighted
sum of three lengths, each as a fraction of the longest in its group::

    penalty_i = mean_G(r) * ( w_out   * out_i   / max_G(out)
                            + w_in    * in_i    / max_G(in)
                            + w_turns * turns_i / max_G(turns) )

``out`` counts the tokens the model generated, ``in`` the context it read but did not generate
(the prompt, and a multi-turn trajectory's tool observations: total tokens minus ``out``),
``turns`` the generated turns (1 for a single-turn response). Each maximum is taken as at least 1,
so an empty quantity adds nothing.

Why scaled by the pass rate: a group that never succeeds (mean reward 0) gets no penalty at all,
so length never becomes the only signal where the task gives none; among successes, the shorter,
cheaper ones are preferred, more so the easier the prompt. Every term is relative to the group, so
the penalty reorders a group's responses without a length scale to tune.

Exactness: the penalty changes the rewards, not the estimators, so whatever advantage comes out is
exactly what the planner prunes (an advantage that is exactly 0). A group whose rewards are all 0
stays constant (penalty 0) and keeps its exact zeros; a group whose rewards are all equal and
positive gets a signal from its lengths, as prime-rl intends.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LENGTH_PENALTY_TYPES: tuple[str, ...] = ("linear",)
"""``algo.length_penalty.type`` (besides null, off): prime-rl's one form."""


@dataclass(frozen=True)
class LengthWeights:
    """The three weights of :func:`linear_length_penalty` (prime-rl's names)."""

    num_output_tokens_weight: float
    num_input_tokens_weight: float
    num_turns_weight: float


def _fraction_of_group_max(values_B: Tensor, group_index_B: Tensor, num_groups: int) -> Tensor:
    """``values_B / max`` over each sequence's group, the max taken as at least 1."""
    max_G = torch.ones(num_groups, dtype=values_B.dtype).scatter_reduce(
        0, group_index_B, values_B, reduce="amax"
    )
    return values_B / max_G[group_index_B]


def linear_length_penalty(
    rewards_B: Tensor,
    group_ids_B: Tensor,
    output_tokens_B: Tensor,
    input_tokens_B: Tensor,
    turns_B: Tensor,
    weights: LengthWeights,
) -> Tensor:
    """The penalty (>= 0 for non-negative rewards) to subtract from each reward; see the module
    docstring. All inputs are ``[B]``; the result is float64."""
    _, group_index_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(group_index_B.max()) + 1 if group_index_B.numel() else 0
    rewards64_B = rewards_B.to(torch.float64)
    size_G = torch.bincount(group_index_B, minlength=num_groups).to(torch.float64)
    sum_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index_B, rewards64_B)
    pass_rate_B = (sum_G / size_G.clamp_min(1))[group_index_B]
    fraction_B = (
        weights.num_output_tokens_weight
        * _fraction_of_group_max(output_tokens_B.to(torch.float64), group_index_B, num_groups)
        + weights.num_input_tokens_weight
        * _fraction_of_group_max(input_tokens_B.to(torch.float64), group_index_B, num_groups)
        + weights.num_turns_weight
        * _fraction_of_group_max(turns_B.to(torch.float64), group_index_B, num_groups)
    )
    return pass_rate_B * fraction_B


def count_turns(response_mask: tuple[int, ...] | None) -> int:
    """Generated turns of a response: the runs of generated (mask 1) tokens; a response without
    a mask (one engine generation) is one turn."""
    if response_mask is None:
        return 1
    runs, previous = 0, 0
    for trained in response_mask:
        if trained and not previous:
            runs += 1
        previous = trained
    return runs

"""Outcome advantages for GRPO-style training.

Every function here is pure tensor code on a flat batch of ``B`` sequences: no process groups,
no model, no Python loop per sequence.  Sequences that were sampled from the same prompt share a
group id; the advantage of a sequence is how much better its reward is than a baseline (its
group's, or the whole batch's).

The estimators and their config names follow verl's ``core_algos`` so that a verl user's
``algo.adv_estimator`` means the same here; every difference is named in the estimator's
docstring.  Two differences hold throughout:

* Outcome rewards only: one scalar per sequence, no per-token rewards and no discount (verl's
  ``gamma`` is 1 for outcome rewards).  A KL folded into the reward
  (``algo.use_kl_in_reward``, :mod:`megarl.algo.kl_reward`) reaches the estimators as that
  scalar: the sum of the penalised token rewards, which is what verl's GRPO, RLOO and
  REINFORCE++-baseline read too.
* A baseline that leaves no signal gives *exactly* 0.0, not float residue: a group (or batch)
  whose rewards are all equal, and a group of one.  verl leaves such a sequence's reward
  unchanged or a rounding residue; megarl zeroes it because the batch planner skips
  sequences whose advantage is exactly 0 (see :func:`zero_advantage_mask`), so a residue would
  waste a forward/backward and corrupt ``critic/advantages/zero_adv_ratio``.
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
    size_B: Tensor


def _output_dtype(rewards_B: Tensor) -> torch.dtype:
    """Keep the caller's float dtype; integer rewards (e.g. 0/1 correctness) become default float."""
    return rewards_B.dtype if rewards_B.is_floating_point() else torch.get_default_dtype()


def _check_inputs(rewards_B: Tensor, group_ids_B: Tensor) -> torch.dtype:
    """Reject malformed batches up front; returns the dtype the advantages will have."""
    if rewards_B.ndim != 1 or rewards_B.shape != group_ids_B.shape:
        raise ValueError(
            f"rewards_B and group_ids_B must both be 1-D of the same length, got "
            f"{tuple(rewards_B.shape)} and {tuple(group_ids_B.shape)}"
        )
    return _output_dtype(rewards_B)


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
        size_B=size_G[group_index_B],
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
            verl calls this ``algo.norm_adv_by_std_in_grpo``.
        eps: keeps the division finite for near-constant groups; verl's default, added to the
            unbiased std (not under the square root).

    Unlike verl, a group of one gets 0 rather than its raw reward ``r / (1 + eps)``: with no
    other sample from the prompt there is nothing to compare against.

    Returns:
        advantages with shape ``[B]`` and the rewards' float dtype.
    """
    out_dtype = _check_inputs(rewards_B, group_ids_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)

    stats = _group_stats(rewards_B, group_ids_B)
    adv_B = rewards_B.to(torch.float64) - stats.mean_B
    if norm_by_std:
        adv_B = adv_B / (stats.std_B + eps)
    adv_B = torch.where(stats.is_constant_B, torch.zeros_like(adv_B), adv_B)
    return adv_B.to(out_dtype)


def zero_advantage_mask(adv_B: Tensor) -> Tensor:
    """True for sequences whose advantage is exactly 0, i.e. that would not move the policy.

    This is what the batch planner prunes, and it is exact for *every* estimator here, not just
    for the structural zeros of constant groups: the PPO clip loss of a token is
    ``max(-A * r, -A * clip(r))`` with a clamped, hence finite, ratio ``r``, so at ``A == 0``
    both the loss and its gradient are exactly 0, and the planner keeps each mini-batch's
    unpruned normaliser.  A whole-batch-whitened advantage that lands on 0.0 by float
    coincidence therefore contributes nothing either, and skipping it is still exact.  What
    does act at ``A == 0`` (``actor.kl_coef``, ``actor.entropy_coef``) is handled by the
    planner's ``prune_mode``, which does not prune then.  Only exact zeros count (``-0.0``
    included): a 1e-30 is kept, since pruning it would not be exact.
    """
    return adv_B == 0


def _whiten_over_batch(values64_B: Tensor, shift_mean: bool, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the whole batch, with the unbiased variance.

    Matches verl's ``masked_whiten`` (``rsqrt(var + 1e-8)``, Bessel-corrected variance), except
    that each *sequence* is one sample where verl counts every response *token*: an outcome
    advantage is one number per sequence, and token weighting would make a sequence's
    advantage depend on how long the other responses are.  With equal response lengths the two
    differ only in Bessel's correction (``B - 1`` sequences here, tokens - 1 in verl).
    ``shift_mean=False`` only scales (the variance is still taken about the mean), for
    inputs whose batch mean is 0 by construction.  A batch of one has no spread: variance 0.
    """
    mean = values64_B.mean()
    var = (values64_B - mean).square().sum() / max(values64_B.numel() - 1, 1)
    centred_B = values64_B - mean if shift_mean else values64_B
    return centred_B * torch.rsqrt(var + eps)


def grpo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """GRPO: group-mean-centred and group-std-normalised."""
    return group_relative_advantages(rewards_B, group_ids_B, norm_by_std=True)


def grpo_no_std_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Dr.GRPO: group-mean-centred only, avoiding the std normalisation's difficulty bias."""
    return group_relative_advantages(rewards_B, group_ids_B, norm_by_std=False)


def rloo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """RLOO: reward minus the mean reward of the *other* samples of the same prompt.

    ``r_i - mean_{j != i} r_j == n / (n - 1) * (r_i - mean_j r_j)``, so the baseline does not
    depend on the sample it scores and the estimate stays unbiased; computed in the second
    form from the same float64 group statistics as GRPO.  A constant group is exactly 0; so is
    a group of one, which has no other sample to compare with (verl's loop version leaves its
    raw reward, its vectorised version gives 0, as here).
    """
    out_dtype = _check_inputs(rewards_B, group_ids_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)
    stats = _group_stats(rewards_B, group_ids_B)
    scale_B = stats.size_B / (stats.size_B - 1).clamp_min(1)
    adv_B = (rewards_B.to(torch.float64) - stats.mean_B) * scale_B
    adv_B = torch.where(stats.is_constant_B, torch.zeros_like(adv_B), adv_B)
    return adv_B.to(out_dtype)


def reinforce_plus_plus_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """REINFORCE++: rewards whitened over the whole batch, no per-prompt baseline.

    ``group_ids_B`` is only validated: the baseline is the batch mean, so a prompt whose samples
    all got the same reward still gets a signal, relative to the other prompts.  Only a batch
    whose rewards are all equal gives (exactly) 0.  With outcome rewards and no KL in the
    reward, verl's discounted return is the reward itself at every token (``gamma = 1``).
    With KL in the reward verl's return-to-go differs per token (each token's return leaves
    out the KL of the tokens before it); here every token gets the whole sequence's score.
    """
    out_dtype = _check_inputs(rewards_B, group_ids_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)
    rewards64_B = rewards_B.to(torch.float64)
    adv_B = _whiten_over_batch(rewards64_B, shift_mean=True)
    if bool(rewards64_B.min() == rewards64_B.max()):
        adv_B = torch.zeros_like(adv_B)  # the batch mean's rounding residue times 1e4
    return adv_B.to(out_dtype)


def reinforce_plus_plus_baseline_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """REINFORCE++-baseline: group mean subtracted, then scaled by the batch's std.

    As verl, the group-centred rewards are whitened over the batch.  Their batch mean is 0 by
    construction when each sequence weighs the same (every group's centred rewards sum to 0),
    so megarl only divides by ``sqrt(var + 1e-8)`` instead of subtracting a rounding residue:
    a constant group stays exactly 0, and so does a sample whose reward equals its group mean.
    verl weighs tokens, whose mean is not 0 when lengths differ, so there a constant group
    gets ``-mean / std``.  A group of one is 0 here; verl uses its raw reward as the advantage
    before whitening.
    """
    out_dtype = _check_inputs(rewards_B, group_ids_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)
    stats = _group_stats(rewards_B, group_ids_B)
    centred_B = rewards_B.to(torch.float64) - stats.mean_B
    centred_B = torch.where(stats.is_constant_B, torch.zeros_like(centred_B), centred_B)
    return _whiten_over_batch(centred_B, shift_mean=False).to(out_dtype)


def maxrl_advantages(rewards_B: Tensor, group_ids_B: Tensor, eps: float = 1e-6) -> Tensor:
    """MaxRL ("Maximum Likelihood Reinforcement Learning",
    arXiv:2602.02710): the group's reward minus its mean, divided by the *mean*::

        A_i = (r_i - mean_j r_j) / (mean_j r_j + eps)

    The paper expands the maximum-likelihood objective in failure events,
    ``log p = -sum_k (1 - p)^k / k`` (``(1 - p)^k`` = fail@k), so that
    ``grad log p = sum_k grad pass@k / k``, of which REINFORCE keeps only ``k = 1``. Dividing
    by the group mean (the empirical pass rate ``p`` for 0/1 rewards) instead of GRPO's std
    makes the gradient an unbiased estimate of that series truncated at order ``n`` (the group
    size): a prompt solved once in ``n`` weighs ~``1/p``, so
    hard prompts are not drowned by easy ones; the group size ``n`` interpolates from
    REINFORCE (1) to maximum likelihood (infinite). ``eps`` is SkyRL's (prime-rl has none).

    For non-negative (canonically 0/1) rewards. A group whose mean is <= 0 has no success to
    raise the likelihood of and gets exactly 0 (as prime-rl); so do constant groups and a
    group of one (SkyRL leaves a singleton its raw reward).
    """
    out_dtype = _check_inputs(rewards_B, group_ids_B)
    if rewards_B.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_B.device)
    stats = _group_stats(rewards_B, group_ids_B)
    adv_B = (rewards_B.to(torch.float64) - stats.mean_B) / (stats.mean_B + eps)
    silent_B = stats.is_constant_B | (stats.mean_B <= 0)
    adv_B = torch.where(silent_B, torch.zeros_like(adv_B), adv_B)
    return adv_B.to(out_dtype)


def gdpo_advantages(
    rewards_BK: Tensor,
    group_ids_B: Tensor,
    weights_K: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """GDPO ("Group reward-Decoupled Normalization Policy Optimization",
    arXiv:2601.05242): each of the ``K`` rewards is normalised within its group on its own,
    the normalised rewards are summed with their weights, and the sum is normalised over the
    batch::

        A_k,i = (r_k,i - mean_group(r_k)) / (std_group(r_k) + eps)
        A_i   = sum_k w_k * A_k,i
        Â_i   = (A_i - mean_batch(A)) / (std_batch(A) + eps)

    Normalising the sum of the rewards instead (GRPO on the weighted sum) maps different
    reward combinations with the same total (``(1, 0)`` and ``(0, 1)``) to one advantage:
    the "reward advantage collapse" the paper names. With one reward (``K == 1``) GDPO is GRPO
    followed by a division by the batch's std.

    Exact zeros, as for GRPO: a reward that is constant within a group (a group of one
    included) contributes exactly 0 to that group's sum, so a group where every reward is
    constant has advantage exactly 0 and is pruned. The batch mean of ``A`` is 0 by
    construction (each group's centred rewards sum to 0), so, as for
    REINFORCE++-baseline, only the division is applied: subtracting its float residue would
    give constant groups a nonzero advantage. Std's are unbiased (NeMo-RL's ``torch.std``).

    Args:
        rewards_BK: ``K`` rewards per sequence (``[B]`` is taken as ``K == 1``).
        group_ids_B: integer group id per sequence.
        weights_K: the weights ``w_k``; None = all 1 (NeMo-RL's default).
        eps: added to each std (the paper's and NeMo-RL's 1e-6).
    """
    if rewards_BK.ndim == 1:
        rewards_BK = rewards_BK[:, None]
    if rewards_BK.ndim != 2:
        raise ValueError(f"rewards_BK must be [B, K], got shape {tuple(rewards_BK.shape)}")
    num_rewards = rewards_BK.shape[1]
    out_dtype = _check_inputs(rewards_BK[:, 0], group_ids_B)
    if weights_K is None:
        weights_K = torch.ones(num_rewards, dtype=torch.float64)
    if weights_K.shape != (num_rewards,):
        raise ValueError(f"weights_K must have {num_rewards} entries, got {tuple(weights_K.shape)}")
    if rewards_BK.shape[0] == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_BK.device)
    summed_B = torch.zeros(rewards_BK.shape[0], dtype=torch.float64, device=rewards_BK.device)
    for k in range(num_rewards):
        normalised_B = group_relative_advantages(
            rewards_BK[:, k].to(torch.float64), group_ids_B, norm_by_std=True, eps=eps
        )
        summed_B = summed_B + float(weights_K[k]) * normalised_B
    if bool((summed_B == 0).all()):
        return summed_B.to(out_dtype)
    std = summed_B.std() if summed_B.numel() > 1 else summed_B.new_zeros(())
    return (summed_B / (std + eps)).to(out_dtype)


def _gdpo_one_reward(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """``gdpo`` as a registry estimator on the one (weighted-sum) reward of each sequence;
    with several reward functions the rollout calls :func:`gdpo_advantages` on them."""
    return gdpo_advantages(rewards_B, group_ids_B)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "grpo_no_std": grpo_no_std_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "maxrl": maxrl_advantages,
    "gdpo": _gdpo_one_reward,
}
"""The one list of estimators: the config schema validates ``algo.adv_estimator`` against it."""

MULTI_REWARD_ESTIMATORS: tuple[str, ...] = ("gdpo",)
"""The estimators that read each reward function's score apart (several ``data.reward``
functions); every other estimator reads their weighted sum."""

ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = tuple(ADVANTAGE_ESTIMATORS)

GROUP_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "grpo_no_std",
    "rloo",
    "reinforce_plus_plus_baseline",
    "maxrl",
    "gdpo",
)
"""The estimators whose baseline is the other samples of the prompt's group: with one sample
per prompt (``rollout.n=1``) every advantage would be 0. REINFORCE++ (a batch baseline) and a
critic's GAE take one sample per prompt."""


def resolve_estimator_name(name: str, norm_adv_by_std_in_grpo: bool = True) -> str:
    """The registry name a config means: verl's ``norm_adv_by_std_in_grpo=false`` turns
    ``grpo`` into ``grpo_no_std`` and, as in verl, is not read by any other estimator."""
    return "grpo_no_std" if name == "grpo" and not norm_adv_by_std_in_grpo else name


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up an estimator by its config name, failing loudly with the names that do exist."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(ADVANTAGE_ESTIMATOR_NAMES)
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}") from None

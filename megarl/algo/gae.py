"""PPO with a learned critic: GAE advantages and returns, the clipped value loss, critic metrics.

The outcome estimators of :mod:`megarl.algo.advantages` give one number per sequence from the
rewards of a group of samples.  PPO instead learns a value function ``V`` (the critic) and
scores every response *token* by Generalized Advantage Estimation (Schulman et al. 2015,
"High-Dimensional Continuous Control Using Generalized Advantage Estimation", eq. 16)::

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = sum_{l >= 0} (gamma * lam)^l * delta_{t+l}

over the response tokens of one sequence, with ``V`` after the last response token taken as 0
(the episode ends there).  ``lam`` trades bias (``lam = 0``: one-step TD error) for variance
(``lam = 1``: Monte-Carlo return minus the baseline).  The critic's regression target is the
return ``A_t + V(s_t)`` *before* the advantages are whitened; the policy reads the whitened
advantages.

Semantics follow verl's ``compute_gae_advantage_return`` so that ``algo.adv_estimator=gae``,
``algo.gamma``, ``algo.lam`` and ``critic.cliprange_value`` mean the same as there:

* Token-level rewards are the sequence's reward on its last response token, minus
  ``beta * kl_t`` on every response token when the KL is in the reward (verl's
  ``token_level_rewards``; :func:`megarl.algo.kl_reward.penalised_token_rewards`).
* Tokens off the response mask are skipped by the recursion: they neither add a TD error nor
  break the chain between the response tokens around them.  megarl additionally sets
  advantages and returns off the mask to exactly 0, where verl leaves the carried values; no
  loss or metric reads them.
* The advantages are whitened over every valid token of the batch (mean removed, divided by
  ``sqrt(unbiased var + 1e-8)``), as verl's ``masked_whiten``.

Zero-advantage pruning does not apply: a token's advantage comes from a learned critic and is
exactly 0 only by coincidence, and the critic's own loss does not vanish at advantage 0 (see
``megarl.planner.pruning.resolve_prune_mode``).

Pure tensor code on ``[B, T]`` response tensors with a mask, like :mod:`megarl.algo.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo.kl_reward import penalised_token_rewards
from megarl.algo.losses import aggregate

WHITEN_EPS = 1e-8
"""verl's ``masked_whiten``: ``(x - mean) * rsqrt(var + 1e-8)``."""

EXPLAINED_VAR_EPS = 1e-5
"""verl's ``critic/vf_explained_var``: ``1 - var(returns - values) / (var(returns) + 1e-5)``."""


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def outcome_token_rewards(rewards_B: Tensor, mask_BT: Tensor) -> Tensor:
    """verl's ``token_level_rewards`` without a KL in the reward: each sequence's reward on its
    last response token, 0 elsewhere (float64).  With ``algo.use_kl_in_reward`` the token
    rewards come from :func:`megarl.algo.kl_reward.apply_kl_penalty` instead."""
    zero_kl_BT = torch.zeros(mask_BT.shape, dtype=torch.float64, device=mask_BT.device)
    return penalised_token_rewards(rewards_B.double(), zero_kl_BT, mask_BT, beta=0.0)


def masked_whiten(values_BT: Tensor, mask_BT: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid tokens of the whole batch; 0 off the mask.

    Every valid token is one sample (verl's ``masked_whiten``), so a long response weighs more
    than a short one, and the variance is Bessel-corrected (``n - 1``).  A batch with a single
    valid token has no spread: it whitens to 0; an empty mask gives all zeros.
    """
    _check_same_shape(values_BT=values_BT, mask_BT=mask_BT)
    valid_BT = mask_BT != 0
    values64_BT = values_BT.double()
    num_valid = int(valid_BT.sum())
    if num_valid == 0:
        return torch.zeros_like(values_BT)
    mean = values64_BT[valid_BT].mean()
    var = (values64_BT[valid_BT] - mean).square().sum() / max(num_valid - 1, 1)
    whitened_BT = (values64_BT - mean) * torch.rsqrt(var + eps)
    return torch.where(valid_BT, whitened_BT, torch.zeros_like(whitened_BT)).to(values_BT.dtype)


@dataclass(frozen=True)
class GAEResult:
    """What GAE gives the two models."""

    advantages_BT: Tensor
    """The policy's per-token advantages, whitened over the batch's valid tokens."""
    returns_BT: Tensor
    """The critic's targets ``A_t + V(s_t)``, from the advantages before whitening."""


def gae_advantage_return(
    token_rewards_BT: Tensor,
    values_BT: Tensor,
    mask_BT: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> GAEResult:
    """GAE (eq. 16 of Schulman et al. 2015) per token, then whitened advantages and returns.

    One backward pass over the token axis, vectorised over sequences: ``A_t = delta_t +
    gamma * lam * A_{t+1}`` where ``t + 1`` is the next *valid* token (masked tokens carry the
    next valid token's value and advantage through), and after a sequence's last valid token
    ``V = 0`` and ``A = 0``.  Computed in float64 and returned in ``values_BT``'s dtype.

    Args:
        token_rewards_BT: per-token rewards (see :func:`outcome_token_rewards`).
        values_BT: the critic's value of each token's state, from the rollout's weights.
        mask_BT: 1 on response tokens, 0 on prompt and padding.
        gamma: discount (``algo.gamma``); 1 for outcome rewards, as verl's default.
        lam: GAE's lambda (``algo.lam``).
    """
    _check_same_shape(token_rewards_BT=token_rewards_BT, values_BT=values_BT, mask_BT=mask_BT)
    rewards64_BT = token_rewards_BT.double()
    values64_BT = values_BT.double()
    valid_BT = mask_BT != 0
    next_value_B = torch.zeros(values_BT.shape[0], dtype=torch.float64, device=values_BT.device)
    next_adv_B = torch.zeros_like(next_value_B)
    adv64_BT = torch.zeros_like(values64_BT)
    for t in reversed(range(values_BT.shape[1])):
        delta_B = rewards64_BT[:, t] + gamma * next_value_B - values64_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        valid_B = valid_BT[:, t]
        next_value_B = torch.where(valid_B, values64_BT[:, t], next_value_B)
        next_adv_B = torch.where(valid_B, adv_B, next_adv_B)
        adv64_BT[:, t] = torch.where(valid_B, adv_B, torch.zeros_like(adv_B))
    returns64_BT = torch.where(valid_BT, adv64_BT + values64_BT, torch.zeros_like(adv64_BT))
    out_dtype = values_BT.dtype if values_BT.is_floating_point() else torch.get_default_dtype()
    return GAEResult(
        advantages_BT=masked_whiten(adv64_BT, mask_BT).to(out_dtype),
        returns_BT=returns64_BT.to(out_dtype),
    )


@dataclass(frozen=True)
class ValueLossOutput:
    """Result of :func:`value_loss`."""

    loss: Tensor
    """Scalar to backpropagate (``critic/vf_loss``)."""
    clipfrac: Tensor
    """Token fraction on which the clipped branch is the larger (``critic/vf_clipfrac``,
    detached, token-mean over this call's mask)."""
    vpred_mean: Tensor
    """Token-mean of the predicted values (``critic/vpred_mean``, detached)."""


def value_loss(
    vpreds_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    cliprange_value: float = 0.5,
    agg: str = "token-mean",
    denom: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> ValueLossOutput:
    """PPO's clipped value loss, ``0.5 * agg(max((v - R)^2, (clip(v) - R)^2))``.

    ``clip(v) = old + clamp(v - old, -c, c)`` keeps the new prediction within
    ``critic.cliprange_value`` of the rollout's value, and the pessimistic ``max`` removes the
    incentive to move further (the value clipping of OpenAI's PPO baselines, as in verl's
    ``compute_value_loss``, including its factor 0.5).  ``agg``, ``denom`` and
    ``loss_scale_factor`` are :func:`megarl.algo.losses.aggregate`'s, so the critic's
    micro-batches and ranks add up to the unsplit loss exactly as the actor's do.
    """
    _check_same_shape(
        vpreds_BT=vpreds_BT, old_values_BT=old_values_BT, returns_BT=returns_BT, mask_BT=mask_BT
    )
    old_BT = old_values_BT.detach().to(vpreds_BT.dtype)
    target_BT = returns_BT.detach().to(vpreds_BT.dtype)
    clipped_BT = old_BT + (vpreds_BT - old_BT).clamp(-cliprange_value, cliprange_value)
    unclipped_loss_BT = (vpreds_BT - target_BT).square()
    clipped_loss_BT = (clipped_BT - target_BT).square()
    loss_BT = torch.maximum(unclipped_loss_BT, clipped_loss_BT)
    with torch.no_grad():
        clipfrac = aggregate(
            (clipped_loss_BT > unclipped_loss_BT).to(vpreds_BT.dtype), mask_BT, "token-mean"
        )
        vpred_mean = aggregate(vpreds_BT.detach(), mask_BT, "token-mean")
    return ValueLossOutput(
        loss=0.5 * aggregate(loss_BT, mask_BT, agg, denom, loss_scale_factor),
        clipfrac=clipfrac,
        vpred_mean=vpred_mean,
    )


def critic_data_metrics(values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """verl's critic data metrics over the valid tokens of one rollout batch.

    ``critic/values/{mean,max,min}`` and ``critic/returns/{mean,max,min}``, and
    ``critic/vf_explained_var = 1 - var(returns - values) / (var(returns) + 1e-5)`` with
    unbiased variances: 1 for a perfect critic, 0 for one no better than a constant, negative
    for a worse one.  An empty mask gives no metrics (nothing was measured).
    """
    _check_same_shape(values_BT=values_BT, returns_BT=returns_BT, mask_BT=mask_BT)
    valid_BT = mask_BT != 0
    values_N = values_BT.double()[valid_BT]
    returns_N = returns_BT.double()[valid_BT]
    if values_N.numel() == 0:
        return {}
    return_diff_var = _unbiased_var(returns_N - values_N)
    explained_var = 1.0 - return_diff_var / (_unbiased_var(returns_N) + EXPLAINED_VAR_EPS)
    return {
        "critic/values/mean": float(values_N.mean()),
        "critic/values/max": float(values_N.max()),
        "critic/values/min": float(values_N.min()),
        "critic/returns/mean": float(returns_N.mean()),
        "critic/returns/max": float(returns_N.max()),
        "critic/returns/min": float(returns_N.min()),
        "critic/vf_explained_var": float(explained_var),
    }


def _unbiased_var(x_N: Tensor) -> float:
    """``torch.var`` (n - 1), but 0 for a single sample instead of nan."""
    return float(x_N.var()) if x_N.numel() > 1 else 0.0

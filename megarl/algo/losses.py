"""Per-token RL losses: PPO clipped surrogate, KL penalties, entropy, and their aggregation.

All per-token tensors are ``[B, T]`` and come with a response mask ``mask_BT`` (float or bool,
1 on response tokens, 0 on prompt and padding).  This module is pure tensor code; the trainer
decides how a mini-batch is split across micro-batches and data-parallel ranks and passes the
matching ``denom`` so that the pieces add up to the unsplit loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum")
KL_PENALTY_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")

# exp() of a log-ratio beyond this overflows float32 or yields useless giant gradients; such a
# token is always clipped (positive advantage) or dominated by the unclipped branch anyway.
MAX_LOG_RATIO = 20.0
# verl's bound on the low-variance KL estimator, which keeps rare outlier tokens from dominating.
LOW_VAR_KL_BOUND = 10.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Result of :func:`policy_loss`.

    Attributes:
        loss: scalar to backpropagate.
        clipfrac: fraction of response tokens on which the clipped branch is active (detached).
        ppo_kl: token-mean of ``old_logp - logp``, how far the policy has moved (detached).
    """

    loss: Tensor
    clipfrac: Tensor
    ppo_kl: Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    """Fail on mismatched per-token shapes instead of letting broadcasting hide the bug."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def _default_denom(mask_BT: Tensor, mode: str) -> Tensor | float:
    """The denominator that makes ``aggregate`` a mean over this batch alone."""
    if mode == "token-mean":
        return mask_BT.sum()
    return float(mask_BT.shape[0])


def _divide_or_zero(total: Tensor, denom: float | Tensor) -> Tensor:
    """``total / denom``, but a graph-carrying zero when denom is 0 (e.g. a fully masked shard).

    The zero keeps ``loss.backward()`` valid on every rank so collective gradient reductions
    still line up; it must not be a fresh constant tensor without a graph.
    """
    if not isinstance(denom, Tensor):
        return total * 0 if denom == 0 else total / denom
    denom = denom.to(device=total.device, dtype=total.dtype)
    is_zero = denom == 0
    safe_denom = torch.where(is_zero, torch.ones_like(denom), denom)
    return torch.where(is_zero, total * 0, total / safe_denom)


def aggregate(
    values_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    denom: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token values to a scalar loss.

    Modes:
        ``"token-mean"``: ``sum(values * mask) / denom``; denom defaults to the number of
        response tokens, so every token weighs the same.
        ``"seq-mean-token-sum"``: ``sum(values * mask) / denom``; denom defaults to the number of
        sequences ``B``, i.e. sum each sequence's tokens, then average over sequences.

    ``denom`` exists because the trainer splits a mini-batch into micro-batches and data-parallel
    shards: normalising every piece by the *whole* mini-batch's count makes the summed pieces (and
    their summed gradients) equal the unsplit loss, whereas per-piece means would weight tokens
    differently depending on how the batch happened to be cut.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_same_shape(values_BT=values_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.to(values_BT.dtype)
    total = (values_BT * mask_BT).sum()
    if denom is None:
        denom = _default_denom(mask_BT, mode)
    return _divide_or_zero(total, denom)


def _per_token_advantages(adv_B_or_BT: Tensor, like_BT: Tensor) -> Tensor:
    """Broadcast a per-sequence advantage ``[B]`` over tokens; pass ``[B, T]`` through."""
    if adv_B_or_BT.ndim == 1:
        if adv_B_or_BT.shape[0] != like_BT.shape[0]:
            raise ValueError(
                f"per-sequence advantages have {adv_B_or_BT.shape[0]} entries for a batch of "
                f"{like_BT.shape[0]} sequences"
            )
        return adv_B_or_BT.unsqueeze(-1).expand_as(like_BT)
    _check_same_shape(adv_BT=adv_B_or_BT, logp_BT=like_BT)
    return adv_B_or_BT


def policy_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_B_or_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    denom: float | Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate, pessimistic over the clipped and unclipped branches.

    Per token: ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with
    ``r = exp(logp - old_logp)``.  Separate ``clip_low``/``clip_high`` allow DAPO's
    "clip-higher", which leaves more room to raise the probability of unlikely tokens.
    A token with advantage exactly 0 contributes exactly 0 to the loss and its gradient.

    ``agg`` and ``denom`` are passed to :func:`aggregate` for the loss; the diagnostics are always
    a token-mean over this call's own mask.
    """
    _check_same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, mask_BT=mask_BT)
    adv_BT = _per_token_advantages(adv_B_or_BT, logp_BT).to(logp_BT.dtype)

    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token_loss_BT = torch.maximum(unclipped_BT, clipped_BT)

    with torch.no_grad():
        clipfrac = aggregate((clipped_BT > unclipped_BT).to(logp_BT.dtype), mask_BT, "token-mean")
        ppo_kl = aggregate(old_logp_BT - logp_BT, mask_BT, "token-mean")
    return PolicyLossOutput(
        loss=aggregate(per_token_loss_BT, mask_BT, agg, denom),
        clipfrac=clipfrac,
        ppo_kl=ppo_kl,
    )


def kl_penalty(logp_BT: Tensor, ref_logp_BT: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    Kinds:
        ``"k1"``: ``logp - ref``; unbiased but high variance and can be negative per token.
        ``"k2"``: ``0.5 * (logp - ref)^2``; biased, low variance, non-negative.
        ``"k3"``: Schulman's ``exp(ref - logp) - (ref - logp) - 1``; unbiased and non-negative.
        ``"low_var_kl"``: k3 as verl computes it, with the log-ratio clamped to +-20 and the
        result clamped to [-10, 10] so a few extreme tokens cannot blow up the penalty.
    """
    _check_same_shape(logp_BT=logp_BT, ref_logp_BT=ref_logp_BT)
    if kind == "k1":
        return logp_BT - ref_logp_BT
    if kind == "k2":
        return 0.5 * (logp_BT - ref_logp_BT).square()
    if kind == "k3":
        return _schulman_k3(ref_logp_BT - logp_BT)
    if kind == "low_var_kl":
        log_ratio_BT = (ref_logp_BT - logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        return _schulman_k3(log_ratio_BT).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"unknown KL penalty {kind!r}; valid kinds: {', '.join(KL_PENALTY_KINDS)}")


def _schulman_k3(ref_minus_logp_BT: Tensor) -> Tensor:
    """``exp(x) - x - 1`` for ``x = ref - logp``: always >= 0, zero iff the policies agree."""
    return torch.exp(ref_minus_logp_BT) - ref_minus_logp_BT - 1


def _at_least_float32(logits_BTV: Tensor) -> Tensor:
    """Upcast half/bfloat16 logits: log-probs in bf16 are off by ~1e-2, which would poison the
    importance ratio ``exp(logp - old_logp)`` far more than the extra memory costs."""
    if logits_BTV.dtype in (torch.float16, torch.bfloat16):
        return logits_BTV.float()
    return logits_BTV


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy ``-sum_v p log p`` of each token's distribution, shape ``[B, T]``.

    Goes through ``log_softmax`` (logsumexp-stable for large logits) and treats vocabulary
    entries with ``-inf`` logits (``p = 0``) as contributing 0, instead of ``0 * -inf = nan``.
    """
    logprobs_BTV = torch.log_softmax(_at_least_float32(logits_BTV), dim=-1)
    probs_BTV = logprobs_BTV.exp()
    finite_logprobs_BTV = logprobs_BTV.masked_fill(torch.isneginf(logprobs_BTV), 0.0)
    return -(probs_BTV * finite_logprobs_BTV).sum(dim=-1)


def token_logprobs_from_logits(
    logits_BTV: Tensor,
    tokens_BT: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """``log_softmax(logits / temperature)`` at the given tokens, shape ``[B, T]``.

    The temperature must match the one used for sampling, otherwise the ratio against the
    rollout's log-probs is off from the start.  Computed as ``logit - logsumexp`` so the full
    ``[B, T, V]`` log-softmax is never materialised; this is the single-device reference that the
    vocab-parallel version is checked against.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits_BTV.shape[:-1] != tokens_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} do not match tokens {tuple(tokens_BT.shape)}"
        )
    scaled_BTV = _at_least_float32(logits_BTV)
    if temperature != 1.0:
        scaled_BTV = scaled_BTV / temperature
    picked_BT = scaled_BTV.gather(-1, tokens_BT.long().unsqueeze(-1)).squeeze(-1)
    return picked_BT - torch.logsumexp(scaled_BTV, dim=-1)

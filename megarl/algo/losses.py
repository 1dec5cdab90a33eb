"""Per-token RL losses (policy gradient, KL penalties, entropy) and their aggregation.

All per-token tensors are ``[B, T]``, one row per sequence, and come with a response mask
``mask_BT`` (float or bool, 1 on response tokens, 0 on prompt and padding).  The policy losses
themselves are in :mod:`megarl.algo.policy_losses`, by name.  This module is pure tensor code;
the trainer decides how a mini-batch is split across micro-batches and data-parallel ranks and
passes the matching ``denom`` (the planner's normaliser) so that the pieces add up to the
unsplit loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo.policy_losses import MAX_LOG_RATIO, ClipSettings, get_policy_loss

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_PENALTY_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
# verl's bound on the low-variance KL estimator, which keeps rare outlier tokens from dominating.
LOW_VAR_KL_BOUND = 10.0


@dataclass(frozen=True)
class PolicyLossOutput:
    """Result of :func:`policy_loss`.

    Attributes:
        loss: scalar to backpropagate.
        clipfrac: fraction of response tokens on which the clip is active (detached).
        ppo_kl: token-mean of ``old_logp - logp``, how far the policy has moved (detached).
        clipfrac_lower: fraction of response tokens on which the dual clip for negative
            advantages is active (detached; 0 for losses without one).
    """

    loss: Tensor
    clipfrac: Tensor
    ppo_kl: Tensor
    clipfrac_lower: Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    """Fail on mismatched per-token shapes instead of letting broadcasting hide the bug."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def _default_denom(mask_BT: Tensor, mode: str, loss_scale_factor: float | None) -> Tensor | float:
    """The denominator that makes ``aggregate`` a mean over this batch alone."""
    if mode == "token-mean":
        return mask_BT.sum()
    num_sequences = float(mask_BT.shape[0])
    if mode == "seq-mean-token-sum-norm":
        scale = loss_scale_factor if loss_scale_factor is not None else mask_BT.shape[1]
        return num_sequences * scale
    return num_sequences


def _token_weights(mask_BT: Tensor, mode: str) -> Tensor:
    """Each token's weight in the numerator: the mask, over the row's token count for
    ``seq-mean-token-mean`` (a weighted mask keeps its weight; an empty row stays 0)."""
    if mode != "seq-mean-token-mean":
        return mask_BT
    num_tokens_B1 = (mask_BT != 0).sum(dim=-1, keepdim=True).clamp(min=1)
    return mask_BT / num_tokens_B1.to(mask_BT.dtype)


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
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce per-token values (one row per sequence) to a scalar loss.

    Modes (verl's names), each ``sum(values * weight) / denom``:
        ``"token-mean"``: weight = mask; denom defaults to the number of response tokens, so
        every token weighs the same.
        ``"seq-mean-token-sum"``: weight = mask; denom defaults to the number of sequences
        ``B``: sum each sequence's tokens, then average over sequences.
        ``"seq-mean-token-mean"``: weight = mask / (the row's response tokens); denom defaults
        to ``B``: each sequence's token mean, then the mean over sequences.
        ``"seq-mean-token-sum-norm"`` (Dr. GRPO): weight = mask; denom defaults to
        ``B * loss_scale_factor`` (``T`` when that is None): token sums over a constant, so a
        long answer does not dilute each token's weight, averaged over sequences.

    ``denom`` exists because the trainer splits a mini-batch into micro-batches and data-parallel
    shards: normalising every piece by the *whole* mini-batch's count (the planner's normaliser)
    makes the summed pieces (and their summed gradients) equal the unsplit loss, whereas
    per-piece means would weight tokens differently depending on how the batch happened to be
    cut. The per-token weights depend on the token's own row only, so they survive any split.
    ``loss_scale_factor`` only shapes the default denom.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    _check_same_shape(values_BT=values_BT, mask_BT=mask_BT)
    mask_BT = mask_BT.to(values_BT.dtype)
    total = (values_BT * _token_weights(mask_BT, mode)).sum()
    if denom is None:
        denom = _default_denom(mask_BT, mode, loss_scale_factor)
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
    *,
    loss: str = "vanilla",
    clip_ratio_c: float = 3.0,
    loss_scale_factor: float | None = None,
    token_weights_BT: Tensor | None = None,
    loss_keys: Mapping[str, float] | None = None,
    selected_BT: Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss ``loss`` (see :mod:`megarl.algo.policy_losses`), aggregated.

    The default, ``vanilla``, is PPO's clipped surrogate per token,
    ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))`` with ``r = exp(logp - old_logp)``,
    bounded by ``-A * clip_ratio_c`` where ``A < 0`` (dual-clip).  A token with advantage exactly
    0 contributes exactly 0 to the loss and its gradient, in every registered loss.

    ``agg``, ``denom`` and ``loss_scale_factor`` are passed to :func:`aggregate` for the loss;
    the diagnostics are always a token-mean over this call's own mask. ``token_weights_BT``
    (detached, e.g. the rollout correction's IS weight times its rejection mask, see
    :mod:`megarl.algo.rollout_correction`) multiplies each token's loss in the numerator only:
    the mask, and so the row counts and the normaliser, stay as they are, which keeps every
    split exact and a zero-advantage token at exactly 0.

    ``loss_keys`` are the loss-specific hyper-parameters of
    :class:`~megarl.algo.policy_losses.ClipSettings` by field name (``tau_pos``, ``kl_tau``,
    ...; unset ones keep their defaults). ``selected_BT`` is what clip_cov and kl_cov need: the
    tokens :mod:`megarl.algo.covariance` selected over the whole batch before the split.
    """
    _check_same_shape(logp_BT=logp_BT, old_logp_BT=old_logp_BT, mask_BT=mask_BT)
    adv_BT = _per_token_advantages(adv_B_or_BT, logp_BT).to(logp_BT.dtype)
    clip = ClipSettings(low=clip_low, high=clip_high, ratio_c=clip_ratio_c, **(loss_keys or {}))
    token_loss = get_policy_loss(loss).per_token(
        logp_BT, old_logp_BT, adv_BT, mask_BT, clip, selected_BT
    )
    loss_BT = token_loss.loss_BT
    if token_weights_BT is not None:
        _check_same_shape(logp_BT=logp_BT, token_weights_BT=token_weights_BT)
        loss_BT = loss_BT * token_weights_BT.detach().to(loss_BT.dtype)

    with torch.no_grad():
        dtype = logp_BT.dtype
        clipfrac = aggregate(token_loss.clipped_BT.to(dtype), mask_BT, "token-mean")
        clipfrac_lower = aggregate(token_loss.clipped_lower_BT.to(dtype), mask_BT, "token-mean")
        ppo_kl = aggregate(old_logp_BT - logp_BT, mask_BT, "token-mean")
    return PolicyLossOutput(
        loss=aggregate(loss_BT, mask_BT, agg, denom, loss_scale_factor),
        clipfrac=clipfrac,
        ppo_kl=ppo_kl,
        clipfrac_lower=clipfrac_lower,
    )


def echo_loss(
    logp_BT: Tensor,
    observation_mask_BT: Tensor,
    agg: str = "token-mean",
    denom: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """ECHO's term (prime-rl's ``echo``): the negative log-likelihood of the observation tokens
    of agent trajectories (tool output, which the policy loss never trains), aggregated as the
    policy loss is (``agg``) and divided by the same ``denom``, the planner's normaliser of the
    policy loss (the mini-batch's trained tokens for ``token-mean``).

    Sharing the policy loss's normaliser keeps every DP / micro-batch split exact without a
    count of its own (a row's weights depend on that row only, as in :func:`aggregate`); the
    weight ``actor.echo_coef`` is therefore relative to the policy loss's scale. prime-rl
    divides its cross-entropy component by its own global token count instead, so the same
    ``alpha`` weighs observations by (observation tokens / trained tokens) more here.
    ``observation_mask_BT`` is 1 (times the row's loss weight) on observation tokens, 0
    elsewhere; the advantage plays no part, so a sequence with advantage 0 still contributes.
    """
    _check_same_shape(logp_BT=logp_BT, observation_mask_BT=observation_mask_BT)
    return aggregate(-logp_BT, observation_mask_BT, agg, denom, loss_scale_factor)


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

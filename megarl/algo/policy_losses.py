"""Policy-gradient losses by name (``actor.policy_loss``): per-token losses, one signature.

Each entry of :data:`POLICY_LOSSES` turns the current and old log-probs of the sampled tokens,
the advantages and the response mask (all ``[B, T]``) into a per-token loss and the tokens its
clip statistics count. Aggregation is not the loss's business: :func:`megarl.algo.losses.
policy_loss` reduces the per-token loss with ``actor.loss_agg`` and the planner's normaliser, so
every loss gets every aggregation and the same split-and-prune exactness.

Rows are sequences. The actor's loss-side tensors are one row per sequence even when the model
ran a packed micro-batch (``MicroBatchTensors.to_rows`` un-packs the logprobs), so a
sequence-level quantity such as GSPO's ratio is a reduction over a row's masked tokens.

Two rules every loss keeps, and ``tests/unit/test_losses.py`` checks for each registered one:

* a token with advantage exactly 0 has loss exactly 0 and gradient exactly 0, which is what
  makes pruning zero-advantage sequences exact;
* a row's loss depends only on that row, so splitting a batch into micro-batches and ranks
  changes nothing once the pieces share one normaliser.

Adding a loss: write a :data:`PolicyLossFn` below and register it in :data:`POLICY_LOSSES`;
the config key, its validation and the README check pick the name up from there.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# exp() of a log-ratio beyond this overflows float32 or yields useless giant gradients; such a
# token is always clipped (positive advantage) or dominated by the unclipped branch anyway.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class ClipSettings:
    """The clip parameters the losses share (verl's key names under ``actor.``)."""

    low: float = 0.2
    """``actor.clip_ratio_low``: the ratio (or IS weight) is clipped below at ``1 - low``."""
    high: float = 0.2
    """``actor.clip_ratio_high``: ... and above at ``1 + high``."""
    ratio_c: float = 3.0
    """``actor.clip_ratio_c``: dual-clip bound of ``vanilla`` for negative advantages, > 1."""

    def __post_init__(self) -> None:
        if not self.low > 0:
            raise ValueError(f"clip low must be > 0, got {self.low}")
        if not self.high > 0:
            raise ValueError(f"clip high must be > 0, got {self.high}")
        if not self.ratio_c > 1:
            raise ValueError(f"clip ratio_c must be > 1, got {self.ratio_c}")


@dataclass(frozen=True)
class TokenPolicyLoss:
    """What a policy loss returns: ``[B, T]`` tensors, masked and reduced by the caller."""

    loss_BT: Tensor
    """Per-token loss (carries the gradient)."""
    clipped_BT: Tensor
    """Bool: the clip is active on this token (``actor/pg_clipfrac``)."""
    clipped_lower_BT: Tensor
    """Bool: the dual clip for negative advantages is active (``actor/pg_clipfrac_lower``);
    all False for losses without one, as verl reports it."""


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, ClipSettings], TokenPolicyLoss]
"""``(logp_BT, old_logp_BT, adv_BT, mask_BT, clip) -> TokenPolicyLoss``. ``adv_BT`` is already
broadcast to tokens and in ``logp_BT``'s dtype; ``mask_BT`` is 0 on prompt, padding and
zero-weight (filler) rows, and only sequence-level losses need it."""


def _log_ratio(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    return (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _no_dual_clip(like_BT: Tensor) -> Tensor:
    return torch.zeros_like(like_BT, dtype=torch.bool)


def vanilla(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip: ClipSettings
) -> TokenPolicyLoss:
    """PPO's clipped surrogate with dual-clip (Ye et al. 2020, arXiv:1912.09729, eq. 5).

    ``max(-A r, -A clip(r, 1 - low, 1 + high))``, pessimistic over both branches; the separate
    ``low``/``high`` allow DAPO's clip-higher. For ``A < 0`` the result is further bounded by
    ``-A * ratio_c``: without it a token whose ratio has grown far above 1 under a negative
    advantage makes the loss (and its gradient) unbounded.
    """
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip.low, 1.0 + clip.high)
    ppo_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_bound_BT = -adv_BT * clip.ratio_c
    negative_BT = adv_BT < 0
    loss_BT = torch.where(negative_BT, torch.minimum(ppo_BT, dual_bound_BT), ppo_BT)
    return TokenPolicyLoss(
        loss_BT=loss_BT,
        clipped_BT=clipped_BT > unclipped_BT,
        clipped_lower_BT=negative_BT & (ppo_BT > dual_bound_BT),
    )


def gspo(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip: ClipSettings
) -> TokenPolicyLoss:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the sequence's importance ratio, clipped.

    ``s_i = exp(mean_t log(pi / pi_old))`` over sequence ``i``'s response tokens (eq. 7), used
    in the token-level form ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (eq. 13): its value is
    ``s_i`` on every token, and its gradient is ``s_i`` times the token's own log-prob
    gradient, so ``actor.loss_agg=seq-mean-token-mean`` gives the paper's eq. 10 exactly. The
    ratio is clipped to ``[1 - low, 1 + high]`` as in PPO, but since it is a per-token geometric
    mean it moves far less than a token ratio: the paper uses ranges like ``3e-4`` / ``4e-4``.
    """
    log_ratio_BT = _log_ratio(logp_BT, old_logp_BT)
    weights_BT = mask_BT.to(logp_BT.dtype)
    num_tokens_B1 = weights_BT.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio_B1 = (log_ratio_BT.detach() * weights_BT).sum(dim=-1, keepdim=True)
    seq_log_ratio_B1 = seq_log_ratio_B1 / num_tokens_B1
    # value s_i everywhere, gradient only through the token's own log-prob
    token_log_ratio_BT = seq_log_ratio_B1 + (logp_BT - logp_BT.detach())
    ratio_BT = torch.exp(token_log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip.low, 1.0 + clip.high)
    return TokenPolicyLoss(
        loss_BT=torch.maximum(unclipped_BT, clipped_BT),
        clipped_BT=clipped_BT > unclipped_BT,
        clipped_lower_BT=_no_dual_clip(logp_BT),
    )


def cispo(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip: ClipSettings
) -> TokenPolicyLoss:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5): REINFORCE with a clipped IS weight.

    ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi``: the importance weight is clipped and
    detached, so, unlike PPO, a clipped token still gets its policy gradient, only with a
    bounded weight. The bounds are the same keys as PPO's, as in verl; MiniMax-M1 sets no lower
    bound (verl's example: ``clip_ratio_low=10``) and tunes only ``clip_ratio_high``.
    """
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT)).detach()
    weight_BT = ratio_BT.clamp(1.0 - clip.low, 1.0 + clip.high)
    return TokenPolicyLoss(
        loss_BT=-weight_BT * adv_BT * logp_BT,
        clipped_BT=weight_BT != ratio_BT,
        clipped_lower_BT=_no_dual_clip(logp_BT),
    )


def sft(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor, clip: ClipSettings
) -> TokenPolicyLoss:
    """Supervised fine-tuning as a policy loss: the weighted negative log-likelihood
    ``-A_t * log pi(y_t)`` (``algo.objective=sft`` gives every trained token ``A = 1``, so its
    token-mean is the usual SFT cross-entropy over the assistant tokens). Nothing is clipped:
    the old logprobs are not read. Both rules hold: ``A = 0`` contributes nothing, and each row
    depends on itself only."""
    return TokenPolicyLoss(
        loss_BT=-adv_BT * logp_BT,
        clipped_BT=torch.zeros_like(logp_BT, dtype=torch.bool),
        clipped_lower_BT=_no_dual_clip(logp_BT),
    )


@dataclass(frozen=True)
class PolicyLoss:
    """One registered loss: its per-token function and the aggregation it is meant with."""

    per_token: PolicyLossFn
    default_agg: str = "token-mean"
    """What ``actor.loss_agg`` left unset (null) means with this loss (an ``AGG_MODES`` name)."""


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss(vanilla),
    # verl always aggregates GSPO with seq-mean-token-mean (the paper's per-sequence mean)
    "gspo": PolicyLoss(gspo, default_agg="seq-mean-token-mean"),
    "cispo": PolicyLoss(cispo),
    "sft": PolicyLoss(sft),
}

POLICY_LOSS_NAMES: tuple[str, ...] = tuple(POLICY_LOSSES)
"""The values of ``actor.policy_loss``."""


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; unknown names list the valid ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"unknown policy loss {name!r}; valid losses: {', '.join(POLICY_LOSS_NAMES)}"
        )
    return POLICY_LOSSES[name]

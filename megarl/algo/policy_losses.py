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
    """The hyper-parameters the losses read (verl's, SAPO's and prime-rl's key names under
    ``actor.``): the clip bounds every ratio-based loss shares, and the few keys of one loss."""

    low: float = 0.2
    """``actor.clip_ratio_low``: the ratio (or IS weight) is clipped below at ``1 - low``;
    DPPO's threshold on the divergence of a token whose probability fell; GMPO's lower bound in
    log space."""
    high: float = 0.2
    """``actor.clip_ratio_high``: ... and above at ``1 + high`` (DPPO, GMPO: as ``low``)."""
    ratio_c: float = 3.0
    """``actor.clip_ratio_c``: dual-clip bound of ``vanilla`` for negative advantages, > 1;
    DPPO's truncation of its detached ratio."""
    tau_pos: float = 1.0
    """``actor.tau_pos``: SAPO's gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """``actor.tau_neg``: SAPO's gate temperature for non-positive advantages."""
    ppo_kl_coef: float = 0.1
    """``actor.ppo_kl_coef``: kl_cov's weight of ``|log r|`` on the selected tokens."""
    kl_tau: float = 1e-3
    """``actor.kl_tau``: prime_dppo's weight of ``(log r)^2`` on every token."""
    adv_tau: float = 1.0
    """``actor.adv_tau``: prime_dppo's scale of the advantage term."""

    def __post_init__(self) -> None:
        if not self.low > 0:
            raise ValueError(f"clip low must be > 0, got {self.low}")
        if not self.high > 0:
            raise ValueError(f"clip high must be > 0, got {self.high}")
        if not self.ratio_c > 1:
            raise ValueError(f"clip ratio_c must be > 1, got {self.ratio_c}")
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("ppo_kl_coef", "kl_tau", "adv_tau"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


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

    @classmethod
    def without_dual_clip(
        cls, loss_BT: Tensor, clipped_BT: Tensor | None = None
    ) -> TokenPolicyLoss:
        """A loss that has no dual clip (``clipped_lower_BT`` all False); ``clipped_BT`` None
        for one that clips nothing either."""
        if clipped_BT is None:
            clipped_BT = torch.zeros_like(loss_BT, dtype=torch.bool)
        return cls(loss_BT, clipped_BT, torch.zeros_like(loss_BT, dtype=torch.bool))


PolicyLossFn = Callable[
    [Tensor, Tensor, Tensor, Tensor, ClipSettings, "Tensor | None"], TokenPolicyLoss
]
"""``(logp_BT, old_logp_BT, adv_BT, mask_BT, clip, selected_BT) -> TokenPolicyLoss``.
``adv_BT`` is already broadcast to tokens and in ``logp_BT``'s dtype; ``mask_BT`` is 0 on
prompt, padding and zero-weight (filler) rows, and only sequence-level losses need it.
``selected_BT`` (bool) is the tokens a batch-level rule picked before the split (clip_cov and
kl_cov: :mod:`megarl.algo.covariance`); None for every other loss."""


def _log_ratio(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    return (logp_BT - old_logp_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def vanilla(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
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
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
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
    return TokenPolicyLoss.without_dual_clip(
        torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT
    )


def cispo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5): REINFORCE with a clipped IS weight.

    ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi``: the importance weight is clipped and
    detached, so, unlike PPO, a clipped token still gets its policy gradient, only with a
    bounded weight. The bounds are the same keys as PPO's, as in verl; MiniMax-M1 sets no lower
    bound (verl's example: ``clip_ratio_low=10``) and tunes only ``clip_ratio_high``.
    """
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT)).detach()
    weight_BT = ratio_BT.clamp(1.0 - clip.low, 1.0 + clip.high)
    return TokenPolicyLoss.without_dual_clip(-weight_BT * adv_BT * logp_BT, weight_BT != ratio_BT)


def sft(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """Supervised fine-tuning as a policy loss: the weighted negative log-likelihood
    ``-A_t * log pi(y_t)`` (``algo.objective=sft`` gives every trained token ``A = 1``, so its
    token-mean is the usual SFT cross-entropy over the assistant tokens). Nothing is clipped:
    the old logprobs are not read. Both rules hold: ``A = 0`` contributes nothing, and each row
    depends on itself only."""
    return TokenPolicyLoss.without_dual_clip(-adv_BT * logp_BT)


def _dppo(
    logp_BT: Tensor, old_logp_BT: Tensor, adv_BT: Tensor, valid_BT: Tensor, clip: ClipSettings
) -> TokenPolicyLoss:
    """DPPO's surrogate once its trust-region mask is known: ``-A sg(min(r, c)) log pi`` on the
    tokens inside the region, 0 outside (the gradient of a masked token is exactly 0)."""
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT))
    weight_BT = ratio_BT.clamp(max=clip.ratio_c).detach()
    return TokenPolicyLoss(
        loss_BT=torch.where(valid_BT, -adv_BT * weight_BT * logp_BT, torch.zeros_like(logp_BT)),
        clipped_BT=~valid_BT,
        clipped_lower_BT=valid_BT & (ratio_BT.detach() > clip.ratio_c),
    )


def dppo_tv(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM RL",
    arXiv:2602.04879v3, eq. 12 with the binary TV of eq. 13): the trust region is a bound on
    the policy's divergence, not its ratio.

    The binary total variation of a sampled token is ``|pi(y) - pi_old(y)|``. A token leaves
    the region only when it moves *in the direction its advantage pushes it*: for ``A > 0`` when
    ``pi - pi_old > clip_ratio_high``, for ``A <= 0`` when ``pi - pi_old < -clip_ratio_low``.
    Inside, the update is the importance-weighted policy gradient
    ``-A * sg(min(r, clip_ratio_c)) * log pi`` (verl's form: the ratio truncated at
    ``clip_ratio_c`` and detached); outside, the token is masked. Unlike a ratio clip, a rare
    token (small ``pi_old``) may move far in ratio while its probability barely changes.
    Eq. 12 weighs ``r A`` (gradient ``r A grad log pi``); verl's detached, truncated form has
    the same gradient while ``r < clip_ratio_c``. The paper anchors the region at the
    behaviour (engine) policy (its Sec. 5.2): ``planner.old_log_prob=rollout`` does that here;
    by default the old log-probs are the trainer's, as in verl.
    """
    with torch.no_grad():
        moved_BT = torch.exp(logp_BT) - torch.exp(old_logp_BT)
        valid_BT = torch.where(adv_BT > 0, moved_BT <= clip.high, moved_BT >= -clip.low)
    return _dppo(logp_BT, old_logp_BT, adv_BT, valid_BT, clip)


def binary_kl(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    """KL(pi_old || pi) of the two-outcome distribution {the sampled token, anything else}:
    ``p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))`` (1e-8 guards the
    second term at probability 1, as verl does)."""
    prob_BT, old_prob_BT = torch.exp(logp_BT), torch.exp(old_logp_BT)
    rest_BT = torch.log((1.0 - old_prob_BT + 1e-8) / (1.0 - prob_BT + 1e-8))
    return old_prob_BT * (old_logp_BT - logp_BT) + (1.0 - old_prob_BT) * rest_BT


def dppo_kl(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """DPPO-Binary-KL (arXiv:2602.04879v3, eq. 12 with the binary KL of eq. 14):
    :func:`dppo_tv` with the binary KL (:func:`binary_kl`) as the divergence. A token with ``A > 0`` leaves the region when its
    probability rose and its binary KL exceeds ``clip_ratio_high``; with ``A <= 0`` when it
    fell and the KL exceeds ``clip_ratio_low``."""
    with torch.no_grad():
        kl_BT = binary_kl(logp_BT, old_logp_BT)
        rose_BT, fell_BT = logp_BT > old_logp_BT, logp_BT < old_logp_BT
        valid_BT = torch.where(
            adv_BT > 0, (kl_BT <= clip.high) | ~rose_BT, (kl_BT <= clip.low) | ~fell_BT
        )
    return _dppo(logp_BT, old_logp_BT, adv_BT, valid_BT, clip)


def prime_dppo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """prime-rl's default loss: DPPO-Binary-TV's mask (arXiv:2602.04879v3, eqs. 12-13) plus
    the squared log-ratio penalty of Kimi K2.5 (arXiv:2602.02276).

    ``-m * adv_tau * A * r + kl_tau * (log r)^2`` with ``r = pi / pi_old`` (not detached, so
    the policy-gradient part is ``-A r grad log pi``) and ``m`` the binary-TV trust-region mask
    of :func:`dppo_tv` (the thresholds are ``clip_ratio_low/high``, prime-rl's
    ``dppo_mask_low/high``, both 0.2 by default there and here). The penalty acts on *every*
    token, zero-advantage ones included, so with ``kl_tau > 0`` this loss does not keep the
    first rule below: pruning zero-advantage sequences is then approximate, and ``auto``
    does not prune (:func:`zero_advantage_term`).

    Why this name: prime-rl calls it ``loss.type=default``, which names no method; it is DPPO-TV
    plus a KL, but ``dppo_kl`` is already verl's name for DPPO with the binary-KL mask.
    """
    log_ratio_BT = _log_ratio(logp_BT, old_logp_BT)
    with torch.no_grad():
        moved_BT = torch.exp(logp_BT) - torch.exp(old_logp_BT)
        masked_BT = torch.where(adv_BT > 0, moved_BT > clip.high, moved_BT < -clip.low)
    pg_BT = torch.where(
        masked_BT, torch.zeros_like(logp_BT), clip.adv_tau * adv_BT * torch.exp(log_ratio_BT)
    )
    return TokenPolicyLoss(
        loss_BT=-pg_BT + clip.kl_tau * log_ratio_BT.square(),
        clipped_BT=masked_BT,
        clipped_lower_BT=masked_BT & (adv_BT < 0),
    )


def geo_mean(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """GMPO (Zhao et al. 2025, Geometric-Mean Policy Optimization, arXiv:2507.20673v3, eq. 4):
    the geometric mean of the clipped token ratios of a sequence, times its advantage.

    Per sequence ``i``: ``s_i = exp(1/|o_i| sum_t sgn(A) min(sgn(A) log r_t, sgn(A)
    clip(log r_t, -clip_ratio_low, clip_ratio_high)))`` -- the clip is in log space, the
    paper's ``(e^-0.4, e^0.4)`` is ``clip_ratio_low = clip_ratio_high = 0.4`` -- and the
    objective is ``A_i s_i``. Every token carries ``-A_t s_i`` (its value is the sequence's;
    its gradient flows through every token of the row), so ``seq-mean-token-mean`` (the
    default here, verl's per-sequence mean) gives ``-1/G sum_i A_i s_i`` exactly. The clip
    statistics are verl's: clipped tokens with ``A > 0`` in ``pg_clipfrac``, ``A < 0`` in
    ``pg_clipfrac_lower``.
    """
    log_ratio_BT = _log_ratio(logp_BT, old_logp_BT)
    sign_BT = torch.sign(adv_BT)
    clamped_BT = log_ratio_BT.clamp(-clip.low, clip.high)
    pessimistic_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * clamped_BT)
    weights_BT = (mask_BT != 0).to(logp_BT.dtype)
    num_tokens_B1 = weights_BT.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_log_ratio_B1 = (pessimistic_BT * weights_BT).sum(dim=-1, keepdim=True) / num_tokens_B1
    seq_ratio_B1 = torch.exp(seq_log_ratio_B1.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped_BT = (log_ratio_BT != clamped_BT).detach()
    return TokenPolicyLoss(
        loss_BT=-adv_BT * seq_ratio_B1,
        clipped_BT=clipped_BT & (adv_BT > 0),
        clipped_lower_BT=clipped_BT & (adv_BT < 0),
    )


def sapo(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization, arXiv:2511.20347, Sec. 3,
    eqs. 5-6): a smooth gate instead of a hard clip.

    ``-f(r) A`` with ``f(r) = 4/tau * sigmoid(tau (r - 1))``, ``tau = tau_pos`` where ``A > 0``
    and ``tau_neg`` otherwise (verl's keys and defaults, 1.0 and 1.05: a negative advantage's
    gate decays faster). At ``r = 1`` the gradient is the plain policy gradient
    (``f'(1) = 1``); as ``r`` leaves 1 it fades smoothly instead of dropping to 0 at a clip
    edge. Nothing is clipped, so the clip statistics are 0. verl aggregates it with
    ``seq-mean-token-mean``: the default here too.
    """
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT))
    tau_BT = torch.where(adv_BT > 0, clip.tau_pos, clip.tau_neg).to(logp_BT.dtype)
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0)) * (4.0 / tau_BT)
    return TokenPolicyLoss.without_dual_clip(-gate_BT * adv_BT)


def gpg(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """GPG (Chu et al. 2025, Group Policy Gradient, arXiv:2504.02546): plain REINFORCE on the
    group-relative advantage, ``-A * log pi``, with no ratio, no clip and no KL: the paper
    trains strictly on-policy (one optimizer step per batch), where PPO's surrogate has the
    same gradient. The old logprobs are not read."""
    return TokenPolicyLoss.without_dual_clip(-adv_BT * logp_BT)


def _require_selection(name: str, selected_BT: Tensor | None, like_BT: Tensor) -> Tensor:
    if selected_BT is None:
        raise ValueError(
            f"policy loss {name} needs the tokens its batch-level rule selected (computed "
            "over the whole batch before the split: megarl.algo.covariance, megarl.algo.m2po)"
        )
    if selected_BT.shape != like_BT.shape:
        raise ValueError(
            f"selected tokens {tuple(selected_BT.shape)} do not match {tuple(like_BT.shape)}"
        )
    return selected_BT.to(device=like_BT.device, dtype=torch.bool)


def clip_cov(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs,
    arXiv:2505.22617v1, Sec. 4, the covariance of eq. 10, Clip-Cov's eqs. 11-12): PPO's clipped
    surrogate, but a few tokens of high covariance
    between log-prob and advantage are detached (their loss and gradient are 0), since those
    are the tokens whose updates collapse the policy's entropy.

    Which tokens is a batch-level rule (a random ``clip_cov_ratio`` of the tokens whose
    centred covariance lies in ``(clip_cov_lb, clip_cov_ub)``): :mod:`megarl.algo.covariance`
    decides it once over the whole batch, before any split; ``selected_BT`` carries the
    outcome. The surrogate is ``vanilla``'s without the dual clip (as verl's clip_cov);
    ``pg_clipfrac`` is the selected fraction, as verl reports it.
    """
    chosen_BT = _require_selection("clip_cov", selected_BT, logp_BT)
    ratio_BT = torch.exp(_log_ratio(logp_BT, old_logp_BT))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip.low, 1.0 + clip.high)
    ppo_BT = torch.maximum(unclipped_BT, clipped_BT)
    return TokenPolicyLoss.without_dual_clip(
        torch.where(chosen_BT, torch.zeros_like(ppo_BT), ppo_BT), chosen_BT
    )


def kl_cov(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """KL-Cov (arXiv:2505.22617v1, Sec. 4, eqs. 13-14): the unclipped surrogate ``-A r`` on every token, plus
    ``ppo_kl_coef * |log r|`` on the ``kl_cov_ratio`` fraction of tokens with the largest
    covariance between log-prob and advantage (selected once over the whole batch by
    :mod:`megarl.algo.covariance`; ``selected_BT``). ``pg_clipfrac`` is the selected
    fraction."""
    chosen_BT = _require_selection("kl_cov", selected_BT, logp_BT)
    log_ratio_BT = _log_ratio(logp_BT, old_logp_BT)
    penalty_BT = torch.where(
        chosen_BT, clip.ppo_kl_coef * log_ratio_BT.abs(), torch.zeros_like(logp_BT)
    )
    return TokenPolicyLoss.without_dual_clip(
        -adv_BT * torch.exp(log_ratio_BT) + penalty_BT, chosen_BT
    )


def m2po(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip: ClipSettings,
    selected_BT: Tensor | None = None,
) -> TokenPolicyLoss:
    """M2PO (Zheng et al. 2025, arXiv:2510.01161v2, Sec. 5: the second moment of eq. 4, the
    masking of Algorithm 1), as AReaL implements it: ``vanilla``'s clipped surrogate against
    the proximal (old) policy, with the tokens the second-moment trust region masked
    (``selected_BT``) contributing nothing. The paper's eq. 5 instead weighs the unmasked
    tokens by the unclipped ratio to the behaviour policy, which megarl's rollout correction
    (``algo.rollout_correction``) and a wide clip approximate.

    The mask drops the tokens of largest ``(log pi_prox - log pi_behav)^2``, fewest first,
    until the mean over the rest is below ``actor.m2_threshold``; it is fitted once over the
    whole batch before the split (:mod:`megarl.algo.m2po`). The staleness itself is weighed
    by the rollout correction (``algo.rollout_correction``, ``pi_prox / pi_behav``), as in
    decoupled PPO. At staleness 0 nothing is masked and this is ``vanilla``.
    ``pg_clipfrac`` counts the masked tokens with the clipped ones.
    """
    chosen_BT = _require_selection("m2po", selected_BT, logp_BT)
    ppo = vanilla(logp_BT, old_logp_BT, adv_BT, mask_BT, clip)
    return TokenPolicyLoss(
        loss_BT=torch.where(chosen_BT, torch.zeros_like(ppo.loss_BT), ppo.loss_BT),
        clipped_BT=ppo.clipped_BT | chosen_BT,
        clipped_lower_BT=ppo.clipped_lower_BT & ~chosen_BT,
    )


@dataclass(frozen=True)
class PolicyLoss:
    """One registered loss: its per-token function and the aggregation it is meant with."""

    per_token: PolicyLossFn
    default_agg: str = "token-mean"
    """What ``actor.loss_agg`` left unset (null) means with this loss (an ``AGG_MODES`` name)."""
    batch_rule: str | None = None
    """The loss reads ``selected_BT``: tokens a rule over the whole batch picked, decided once
    before the batch is split: ``covariance`` (:mod:`megarl.algo.covariance`) or
    ``second_moment`` (:mod:`megarl.algo.m2po`); None for a loss of each row alone."""


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss(vanilla),
    # verl always aggregates GSPO with seq-mean-token-mean (the paper's per-sequence mean)
    "gspo": PolicyLoss(gspo, default_agg="seq-mean-token-mean"),
    "cispo": PolicyLoss(cispo),
    "sft": PolicyLoss(sft),
    "dppo_tv": PolicyLoss(dppo_tv),
    "dppo_kl": PolicyLoss(dppo_kl),
    "prime_dppo": PolicyLoss(prime_dppo),
    # GMPO's and SAPO's papers (and verl) average per sequence
    "geo_mean": PolicyLoss(geo_mean, default_agg="seq-mean-token-mean"),
    "sapo": PolicyLoss(sapo, default_agg="seq-mean-token-mean"),
    "gpg": PolicyLoss(gpg),
    "clip_cov": PolicyLoss(clip_cov, batch_rule="covariance"),
    "kl_cov": PolicyLoss(kl_cov, batch_rule="covariance"),
    "m2po": PolicyLoss(m2po, batch_rule="second_moment"),
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


COVARIANCE_LOSSES: tuple[str, ...] = tuple(
    n for n, e in POLICY_LOSSES.items() if e.batch_rule == "covariance"
)
"""The losses that select tokens by the batch's covariance (clip_cov, kl_cov)."""
SECOND_MOMENT_LOSSES: tuple[str, ...] = tuple(
    n for n, e in POLICY_LOSSES.items() if e.batch_rule == "second_moment"
)
"""The losses that mask tokens by the batch's second moment of the staleness (m2po)."""


def zero_advantage_term(name: str, clip: ClipSettings) -> str | None:
    """Why loss ``name`` with these settings gives a zero-advantage token a non-zero loss (the
    first rule broken, so pruning zero-advantage sequences is not exact), or None when it keeps
    the rule. Only prime_dppo's ``(log r)^2`` penalty does, while ``kl_tau > 0``."""
    if name == "prime_dppo" and clip.kl_tau > 0:
        return f"actor.policy_loss=prime_dppo penalises kl_tau={clip.kl_tau} x (log r)^2 on every token"
    return None

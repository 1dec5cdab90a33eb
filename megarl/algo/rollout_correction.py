"""Rollout correction: the engine sampled from pi_rollout, PPO's ratio starts from pi_old.

The rollout engine (another kernel, another dtype, another batch shape) and the trainer give the
same token under the same weights slightly different probabilities. PPO's ratio ``pi / pi_old``
assumes the samples were drawn from ``pi_old``; they were drawn from ``pi_rollout``. This module
measures that mismatch every step and, when ``algo.rollout_correction`` asks for it, corrects
the policy loss (verl's "decoupled" mode, with verl's keys and metric names):

* **truncated importance sampling** (``rollout_is``): each token's policy loss is multiplied by
  the detached weight ``w = min(rho, rollout_is_threshold)``, where ``rho = pi_old /
  pi_rollout`` is the token's own ratio (``token``) or the product over its response,
  ``exp(sum_t log rho_t)`` (``sequence``, the same weight on every token of the response);
* **rejection** (``rollout_rs``): a token (``token``) or a whole response (``sequence``: the
  product of its ratios; ``geometric``: their geometric mean ``exp(mean_t log rho_t)``) whose
  ratio leaves ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` gets weight 0;
* **veto** (``rollout_token_veto_threshold``): a response in which any token's own ratio falls
  below the threshold gets weight 0 on every token. One catastrophic token (the trainer gives
  it, say, 10^4 times less probability than the engine did) marks a response the engine
  sampled from a different distribution altogether; the threshold is compared with the raw
  ratio, before the ``exp`` safety bound, so even a ratio of e^-200 is caught. The veto is
  independent of ``rollout_is`` and ``rollout_rs`` and applies on top of them.

"old" is the trainer's own log-prob under the weights that generated the rollout: recomputed by
the old-logprob pass, or, on the slice trained first, the training forward itself (the weights
have not moved yet, so it computes the same numbers; see :mod:`megarl.planner.gates`). It is
never the engine's: with ``planner.old_log_prob=rollout`` the ratio would be 1 everywhere, and
start-up refuses that combination.

Normaliser: a rejected (or vetoed) token keeps its place in the loss's denominator and
contributes 0 to the numerator, exactly like a token whose IS weight is 0. The denominator is the
planner's normaliser, fixed from the lengths before any log-prob exists, so it cannot know which
tokens will be rejected; keeping them counted is what keeps every DP / micro-batch split and
zero-advantage pruning exact. (verl instead drops rejected tokens from its micro-batch's
denominator; here the loss is scaled by the kept fraction instead, the direction of the
gradient is the same.)

Exactness: a weight depends only on its own row (rows are whole sequences, packed micro-batches
included) and multiplies the per-token loss, so a zero-advantage token stays exactly 0 in loss
and gradient, and the split and pruned losses still equal the unsplit one.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo.policy_losses import MAX_LOG_RATIO
from megarl.algo.summable import SummableStats, maximum

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""The values of ``algo.rollout_correction.rollout_is`` (null: no IS weights)."""
ROLLOUT_RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""The values of ``algo.rollout_correction.rollout_rs`` (null: no rejection)."""
DEFAULT_IS_THRESHOLD = 2.0
"""verl's default ``rollout_is_threshold``."""


@dataclass(frozen=True)
class CorrectionSettings:
    """What the correction does, thresholds resolved (see ``RolloutCorrectionConfig``)."""

    rollout_is: str | None = None
    """``token`` | ``sequence`` | None (weights 1)."""
    is_threshold: float = DEFAULT_IS_THRESHOLD
    """IS weights are truncated at this value (and the metrics count ratios above it)."""
    rollout_rs: str | None = None
    """``token`` | ``sequence`` | ``geometric`` | None (nothing rejected)."""
    rs_upper: float = DEFAULT_IS_THRESHOLD
    """Rejected above this ratio."""
    rs_lower: float = 1 / DEFAULT_IS_THRESHOLD
    """Rejected below this ratio."""
    veto_threshold: float | None = None
    """A response with a token whose ratio is below this is dropped whole; None = no veto."""

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_LEVELS} or None")
        if self.rollout_rs is not None and self.rollout_rs not in ROLLOUT_RS_LEVELS:
            raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_LEVELS} or None")
        if not self.is_threshold > 0:
            raise ValueError(f"is_threshold must be > 0, got {self.is_threshold}")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            raise ValueError(f"veto_threshold must be in (0, 1) or None, got {self.veto_threshold}")
        if self.rollout_rs is None:
            return  # the bounds are unused
        if not 0 <= self.rs_lower <= 1 <= self.rs_upper or self.rs_lower == self.rs_upper:
            raise ValueError(
                f"rejection bounds must satisfy 0 <= lower <= 1 <= upper, lower < upper; got "
                f"[{self.rs_lower}, {self.rs_upper}]"
            )

    @property
    def enabled(self) -> bool:
        """Whether the loss changes at all (the metrics are reported either way)."""
        levels = (self.rollout_is, self.rollout_rs, self.veto_threshold)
        return any(level is not None for level in levels)


@dataclass(frozen=True)
class RolloutCorrection:
    """Per-token factors of the policy loss, ``[B, T]``, detached, 0 off the mask."""

    is_weights_BT: Tensor
    """Truncated IS weight (1 on every response token when ``rollout_is`` is None)."""
    keep_BT: Tensor
    """1 where the token is kept, 0 where rejection or the veto dropped it (or off the mask)."""

    @property
    def token_weights_BT(self) -> Tensor:
        """What multiplies the per-token policy loss."""
        return self.is_weights_BT * self.keep_BT


def _token_log_ratio(old_logp_BT: Tensor, rollout_logp_BT: Tensor, tokens_BT: Tensor) -> Tensor:
    """``log(pi_old / pi_rollout)`` per token, 0 off the mask, bounded so exp() stays finite."""
    log_ratio_BT = (old_logp_BT.detach() - rollout_logp_BT.detach()).to(torch.float64)
    return torch.where(tokens_BT, log_ratio_BT, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _catastrophic_tokens(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, tokens_BT: Tensor, veto_threshold: float | None
) -> Tensor:
    """Bool ``[B, T]``: the tokens whose raw ratio is below the veto threshold (none if off).

    Compared in log space on the unbounded log-ratio, so no ratio is too small to be caught.
    """
    if veto_threshold is None:
        return torch.zeros_like(tokens_BT)
    log_ratio_BT = (old_logp_BT.detach() - rollout_logp_BT.detach()).to(torch.float64)
    return tokens_BT & (log_ratio_BT < math.log(veto_threshold))


def _sequence_log_ratio(log_ratio_BT: Tensor, tokens_BT: Tensor, mean: bool) -> Tensor:
    """``[B, 1]``: the log of the response's product of ratios, or of their geometric mean."""
    total_B1 = log_ratio_BT.sum(dim=-1, keepdim=True)
    if mean:
        total_B1 = total_B1 / tokens_BT.sum(dim=-1, keepdim=True).clamp(min=1)
    return total_B1.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _level_log_ratio(level: str, log_ratio_BT: Tensor, tokens_BT: Tensor) -> Tensor:
    """The log-ratio a level judges, broadcast to ``[B, T]``."""
    if level == "token":
        return log_ratio_BT
    seq_B1 = _sequence_log_ratio(log_ratio_BT, tokens_BT, mean=level == "geometric")
    return seq_B1.expand_as(log_ratio_BT)


def compute_correction(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, settings: CorrectionSettings
) -> RolloutCorrection:
    """The IS weights and rejection mask of one batch of rows (one row per sequence)."""
    if old_logp_BT.shape != rollout_logp_BT.shape or old_logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"per-token tensors must have the same shape, got {tuple(old_logp_BT.shape)}, "
            f"{tuple(rollout_logp_BT.shape)}, {tuple(mask_BT.shape)}"
        )
    tokens_BT = mask_BT != 0
    dtype = old_logp_BT.dtype
    log_ratio_BT = _token_log_ratio(old_logp_BT, rollout_logp_BT, tokens_BT)
    weights_BT = tokens_BT.to(torch.float64)
    if settings.rollout_is is not None:
        level_BT = _level_log_ratio(settings.rollout_is, log_ratio_BT, tokens_BT)
        weights_BT = weights_BT * level_BT.exp().clamp(max=settings.is_threshold)
    keep_BT = tokens_BT
    if settings.rollout_rs is not None:
        ratio_BT = _level_log_ratio(settings.rollout_rs, log_ratio_BT, tokens_BT).exp()
        keep_BT = tokens_BT & (ratio_BT >= settings.rs_lower) & (ratio_BT <= settings.rs_upper)
    if settings.veto_threshold is not None:
        catastrophic_BT = _catastrophic_tokens(
            old_logp_BT, rollout_logp_BT, tokens_BT, settings.veto_threshold
        )
        keep_BT = keep_BT & ~catastrophic_BT.any(dim=-1, keepdim=True)
    return RolloutCorrection(is_weights_BT=weights_BT.to(dtype), keep_BT=keep_BT.to(dtype))


@dataclass(frozen=True)
class MismatchStats(SummableStats):
    """Sums (and extremes) over compared tokens and sequences, mergeable across ranks.

    The trainer sums the :meth:`~megarl.algo.summable.SummableStats.to_row` of every rank and
    takes the maximum of the ``max_row`` (the :func:`~megarl.algo.summable.maximum` fields;
    minima are stored negated), then :meth:`metrics` forms the ``rollout_corr/*`` values.
    "IS units" are tokens, or sequences when ``rollout_is=sequence``: what a weight belongs to.
    """

    num_tokens: float = 0.0
    num_seqs: float = 0.0
    log_ratio_sum: float = 0.0
    """Sum of ``log(pi_old / pi_rollout)`` over tokens."""
    k3_sum: float = 0.0
    """Sum of ``rho - log rho - 1`` over tokens (k3 estimate of KL(pi_rollout || pi_old))."""
    token_ratio_sq_sum: float = 0.0
    seq_ratio_sq_sum: float = 0.0
    is_units: float = 0.0
    is_ratio_sum: float = 0.0
    is_above_threshold: float = 0.0
    """IS units whose ratio exceeds ``rollout_is_threshold`` (the truncated ones)."""
    rejected_tokens: float = 0.0
    rejected_seqs: float = 0.0
    """Sequences with at least one rejected token (rejection only, not the veto)."""
    ess_weight_sum: float = 0.0
    """Sum over IS units of the ratio clamped to ``[1 / rollout_is_threshold,
    rollout_is_threshold]`` (verl's weights for the effective sample size)."""
    ess_weight_sq_sum: float = 0.0
    """Sum of the squares of those clamped ratios."""
    catastrophic_tokens: float = 0.0
    """Tokens whose raw ratio is below ``rollout_token_veto_threshold`` (0 when it is off)."""
    vetoed_seqs: float = 0.0
    """Sequences with at least one catastrophic token: the veto drops them whole."""
    is_ratio_max: float = maximum()
    is_ratio_neg_min: float = maximum()
    """Minus the smallest IS-unit ratio (so both extremes reduce with a maximum)."""

    def metrics(self) -> dict[str, float]:
        """verl's ``rollout_corr/*`` names; NaN when no token was compared.

        ``rollout_is_eff_sample_size`` is verl's normalised effective sample size of the IS
        weights, ``1 / mean((w / mean w)^2) = (sum w)^2 / (n sum w^2)`` over the ``n`` IS units
        with ``w`` the ratio clamped to ``[1 / rollout_is_threshold, rollout_is_threshold]``: the
        fraction of the batch the weighted estimate is worth. 1 = uniform weights (every unit
        counts fully, as without correction); ``1 / n`` = one unit carries all the weight. It
        comes from sums, so merging ranks gives the ESS of the whole batch, not a mean of ESSs.
        """
        if self.num_tokens == 0:
            return dict.fromkeys(METRIC_NAMES, math.nan)
        tokens, seqs, units = self.num_tokens, max(self.num_seqs, 1.0), max(self.is_units, 1.0)
        catastrophic = self.catastrophic_tokens
        return {
            "rollout_corr/kl": -self.log_ratio_sum / tokens,
            "rollout_corr/k3_kl": self.k3_sum / tokens,
            "rollout_corr/chi2_token": self.token_ratio_sq_sum / tokens - 1.0,
            "rollout_corr/chi2_seq": self.seq_ratio_sq_sum / seqs - 1.0,
            "rollout_corr/rollout_is_mean": self.is_ratio_sum / units,
            "rollout_corr/rollout_is_max": self.is_ratio_max,
            "rollout_corr/rollout_is_min": -self.is_ratio_neg_min,
            "rollout_corr/rollout_is_ratio_fraction_high": self.is_above_threshold / units,
            "rollout_corr/rollout_rs_masked_fraction": self.rejected_tokens / tokens,
            "rollout_corr/rollout_rs_seq_masked_fraction": self.rejected_seqs / seqs,
            "rollout_corr/rollout_is_eff_sample_size": self._eff_sample_size(),
            "rollout_corr/rollout_is_veto_fraction": self.vetoed_seqs / seqs,
            "rollout_corr/rollout_is_catastrophic_token_fraction": catastrophic / tokens,
        }

    def _eff_sample_size(self) -> float:
        if self.is_units == 0 or self.ess_weight_sq_sum == 0:
            return math.nan
        return self.ess_weight_sum**2 / (self.is_units * self.ess_weight_sq_sum)


METRIC_NAMES: tuple[str, ...] = tuple(MismatchStats(num_tokens=1.0).metrics())
"""Every ``rollout_corr/*`` metric, reported every step."""


def mismatch_stats(
    old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, settings: CorrectionSettings
) -> MismatchStats:
    """How far ``pi_rollout`` is from ``pi_old`` on these rows, and what the correction does.

    Ratios are ``rho = pi_old / pi_rollout`` of the sampled tokens (samples from
    ``pi_rollout``), so ``-mean log rho`` estimates KL(pi_rollout || pi_old), ``mean(rho - log
    rho - 1)`` is its k3 estimate, and ``mean(rho^2) - 1`` the chi-square divergence, per token
    and per sequence (with the sequence's product of ratios). The IS statistics are of the raw
    ratio before truncation, at the ``rollout_is`` level (token when it is None); the effective
    sample size (see :meth:`MismatchStats.metrics`) of that ratio clamped as verl clamps it. The
    rejection fractions count rejection alone; the veto has its own two counts (verl's split).
    Unlike verl, whose ESS and mean of sequence weights average them over tokens, every IS
    statistic here counts a sequence-level weight once per sequence.
    """
    tokens_BT = mask_BT != 0
    with torch.no_grad():
        log_ratio_BT = _token_log_ratio(old_logp_BT, rollout_logp_BT, tokens_BT)
        ratio_BT = torch.where(tokens_BT, log_ratio_BT.exp(), 0.0)
        rows_B = tokens_BT.any(dim=-1)
        seq_ratio_B = _sequence_log_ratio(log_ratio_BT, tokens_BT, mean=False).squeeze(-1).exp()
        by_sequence = settings.rollout_is == "sequence"
        is_ratio = seq_ratio_B[rows_B] if by_sequence else ratio_BT[tokens_BT]
        rejection_only = dataclasses.replace(settings, rollout_is=None, veto_threshold=None)
        keep_BT = compute_correction(
            old_logp_BT, rollout_logp_BT, mask_BT, rejection_only
        ).keep_BT.to(torch.bool)
        rejected_BT = tokens_BT & ~keep_BT
        catastrophic_BT = _catastrophic_tokens(
            old_logp_BT, rollout_logp_BT, tokens_BT, settings.veto_threshold
        )
        ess_w = is_ratio.clamp(*sorted((1 / settings.is_threshold, settings.is_threshold)))
        has_units = is_ratio.numel() > 0
        return MismatchStats(
            num_tokens=float(tokens_BT.sum()),
            num_seqs=float(rows_B.sum()),
            log_ratio_sum=float(log_ratio_BT.sum()),
            k3_sum=float(torch.where(tokens_BT, ratio_BT - log_ratio_BT - 1, 0.0).sum()),
            token_ratio_sq_sum=float(ratio_BT.square().sum()),
            seq_ratio_sq_sum=float(seq_ratio_B[rows_B].square().sum()),
            is_units=float(is_ratio.numel()),
            is_ratio_sum=float(is_ratio.sum()),
            is_above_threshold=float((is_ratio > settings.is_threshold).sum()),
            rejected_tokens=float(rejected_BT.sum()),
            rejected_seqs=float(rejected_BT.any(dim=-1).sum()),
            ess_weight_sum=float(ess_w.sum()),
            ess_weight_sq_sum=float(ess_w.square().sum()),
            catastrophic_tokens=float(catastrophic_BT.sum()),
            vetoed_seqs=float(catastrophic_BT.any(dim=-1).sum()),
            is_ratio_max=float(is_ratio.max()) if has_units else -math.inf,
            is_ratio_neg_min=float(-is_ratio.min()) if has_units else -math.inf,
        )


def mismatch_stats_of_sequences(
    old_logprobs: Mapping[int, Tensor],
    rollout_logprobs: Mapping[int, Tensor],
    settings: CorrectionSettings,
    masks: Mapping[int, Tensor] | None = None,
) -> MismatchStats:
    """:func:`mismatch_stats` of the sequences in ``old_logprobs`` (1-D response log-probs,
    keyed by sequence index), each against its rollout log-probs; ``masks`` (by sequence, 1
    where a token was generated) leaves a multi-turn trajectory's observation tokens out."""
    if not old_logprobs:
        return MismatchStats()
    keys = sorted(old_logprobs)
    old = [old_logprobs[i].detach().double().cpu().reshape(-1) for i in keys]
    rollout = [rollout_logprobs[i].detach().double().cpu().reshape(-1) for i in keys]
    for i, a, b in zip(keys, old, rollout, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: {a.numel()} trainer vs {b.numel()} engine logprobs")
    pad = torch.nn.utils.rnn.pad_sequence
    masks = masks or {}
    mask_BT = pad(
        [
            masks[i].detach().double().cpu().reshape(-1) if i in masks else torch.ones_like(a)
            for i, a in zip(keys, old, strict=True)
        ],
        batch_first=True,
    )
    return mismatch_stats(
        pad(old, batch_first=True), pad(rollout, batch_first=True), mask_BT, settings
    )

"""Rollout correction (truncated IS, rejection, veto) and its metrics on hand-made numbers.

The reference is the definition in verl's rollout-correction docs (decoupled mode): the IS
weight of a token is ``min(rho, threshold)`` with ``rho = pi_old / pi_rollout`` of the token
(``token``) or the product over its response (``sequence``); rejection drops a token or
response whose ratio (token, product, or geometric mean) leaves ``[lower, upper]``; the veto
(``rollout_token_veto_threshold``) drops a whole response in which some valid token's own ratio
is below the threshold; the effective sample size is ``1 / mean((w / mean w)^2)`` of the
ratios clamped to ``[1 / rollout_is_threshold, rollout_is_threshold]``.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.policy_losses import loss_extras

from megarl.algo.losses import AGG_MODES, policy_loss
from megarl.algo.policy_losses import POLICY_LOSS_NAMES
from megarl.algo.rollout_correction import (
    METRIC_NAMES,
    CorrectionSettings,
    MismatchStats,
    compute_correction,
    mismatch_stats,
    mismatch_stats_of_sequences,
)
from megarl.planner.optimizer_steps import normaliser_of

# Row 0: token ratios 2, 1, 1/4 (three tokens); row 1: ratios 3, 1/2 and one padding slot.
RATIOS_BT = torch.tensor([[2.0, 1.0, 0.25], [3.0, 0.5, 1.0]], dtype=torch.float64)
MASK_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ROLLOUT_LOGP_BT = torch.log(torch.tensor([[0.2, 0.5, 0.8], [0.1, 0.6, 0.3]], dtype=torch.float64))
OLD_LOGP_BT = ROLLOUT_LOGP_BT + RATIOS_BT.log()


def _correction(**settings: object):
    return compute_correction(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, CorrectionSettings(**settings))  # type: ignore[arg-type]


def _assert_rows(got: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


def test_off_is_weight_one_on_tokens_zero_on_padding() -> None:
    corr = _correction()
    _assert_rows(corr.token_weights_BT, [[1, 1, 1], [1, 1, 0]])
    assert not CorrectionSettings().enabled


def test_token_is_is_the_truncated_token_ratio() -> None:
    corr = _correction(rollout_is="token", is_threshold=1.5)
    _assert_rows(corr.is_weights_BT, [[1.5, 1.0, 0.25], [1.5, 0.5, 0.0]])
    _assert_rows(corr.keep_BT, [[1, 1, 1], [1, 1, 0]])


def test_sequence_is_is_the_truncated_product_on_every_token() -> None:
    # products: 2 * 1 * 0.25 = 0.5; 3 * 0.5 = 1.5 (the padding slot's ratio does not count)
    corr = _correction(rollout_is="sequence", is_threshold=1.2)
    _assert_rows(corr.is_weights_BT, [[0.5, 0.5, 0.5], [1.2, 1.2, 0.0]])


def test_token_rejection_drops_tokens_outside_the_bounds() -> None:
    corr = _correction(rollout_rs="token", rs_lower=0.5, rs_upper=2.0)
    _assert_rows(corr.keep_BT, [[1, 1, 0], [0, 1, 0]])  # 2 and 0.5 are inside (closed bounds)
    _assert_rows(corr.is_weights_BT, [[1, 1, 1], [1, 1, 0]])


def test_sequence_rejection_judges_the_product() -> None:
    # products 0.5 and 1.5: with [0.6, 2] the first response goes, the second stays
    corr = _correction(rollout_rs="sequence", rs_lower=0.6, rs_upper=2.0)
    _assert_rows(corr.keep_BT, [[0, 0, 0], [1, 1, 0]])


def test_geometric_rejection_judges_the_geometric_mean() -> None:
    # geometric means 0.5^(1/3) = 0.794 and 1.5^(1/2) = 1.225
    corr = _correction(rollout_rs="geometric", rs_lower=0.8, rs_upper=1.3)
    _assert_rows(corr.keep_BT, [[0, 0, 0], [1, 1, 0]])
    corr = _correction(rollout_rs="geometric", rs_lower=0.75, rs_upper=1.2)
    _assert_rows(corr.keep_BT, [[1, 1, 1], [0, 0, 0]])


def test_is_and_rejection_combine() -> None:
    corr = _correction(rollout_is="token", is_threshold=2.0, rollout_rs="token", rs_lower=0.3)
    _assert_rows(corr.token_weights_BT, [[2.0, 1.0, 0.0], [0.0, 0.5, 0.0]])


def test_weights_are_detached_and_extreme_ratios_finite() -> None:
    old_BT = torch.tensor([[0.0, -200.0]], requires_grad=True)
    rollout_BT = torch.tensor([[-200.0, 0.0]])
    corr = compute_correction(
        old_BT, rollout_BT, torch.ones(1, 2), CorrectionSettings(rollout_is="sequence")
    )
    assert not corr.is_weights_BT.requires_grad
    assert torch.isfinite(corr.token_weights_BT).all()


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"rollout_is": "geometric"}, "rollout_is"),
        ({"rollout_rs": "tokens"}, "rollout_rs"),
        ({"is_threshold": 0.0}, "is_threshold"),
        ({"rollout_rs": "token", "rs_lower": 1.1, "rs_upper": 2.0}, "lower <= 1 <= upper"),
        ({"rollout_rs": "token", "rs_lower": 0.5, "rs_upper": 0.9}, "lower <= 1 <= upper"),
        ({"rollout_rs": "sequence", "rs_lower": 1.0, "rs_upper": 1.0}, "lower < upper"),
        ({"veto_threshold": 0.0}, "veto_threshold"),
        ({"veto_threshold": 1.0}, "veto_threshold"),
        ({"veto_threshold": -1e-4}, "veto_threshold"),
    ],
)
def test_settings_are_validated(settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CorrectionSettings(**settings)


# ----------------------------------------------------------------------------- veto


def test_veto_drops_every_token_of_a_response_with_a_catastrophic_token() -> None:
    """Row 0 has a token at ratio 1/4, row 1 none below 1/2: a threshold of 0.3 drops row 0
    whole and leaves row 1; the IS weights themselves are untouched (verl: the veto is a mask)."""
    corr = _correction(rollout_is="token", is_threshold=2.0, veto_threshold=0.3)
    _assert_rows(corr.keep_BT, [[0, 0, 0], [1, 1, 0]])
    _assert_rows(corr.is_weights_BT, [[2.0, 1.0, 0.25], [2.0, 0.5, 0.0]])
    _assert_rows(corr.token_weights_BT, [[0, 0, 0], [2.0, 0.5, 0.0]])
    assert CorrectionSettings(veto_threshold=0.3).enabled


@pytest.mark.parametrize(
    ("threshold", "kept_rows"),
    [(0.2, [1, 1]), (0.25, [1, 1]), (0.26, [0, 1]), (0.5, [0, 1]), (0.51, [0, 0])],
)
def test_veto_is_strictly_below_the_threshold(threshold: float, kept_rows: list[int]) -> None:
    """verl vetoes a token when ``ratio < threshold``: a ratio equal to it survives."""
    keep_BT = _correction(veto_threshold=threshold).keep_BT
    expected = [[kept_rows[0]] * 3, [kept_rows[1]] * 2 + [0]]
    _assert_rows(keep_BT, expected)


def test_veto_ignores_padding_and_sees_past_the_safety_bound() -> None:
    """A padding slot's ratio never vetoes; a real token at ratio e^-300 does, although the
    IS weights bound every log-ratio at -20 (the veto compares the raw log-ratio)."""
    old_BT = torch.tensor([[-1.0, -1.0, -300.0], [-1.0, -301.0, -1.0]], dtype=torch.float64)
    rollout_BT = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    settings = CorrectionSettings(veto_threshold=1e-12)  # log = -27.6, beyond the -20 bound
    corr = compute_correction(old_BT, rollout_BT, mask_BT, settings)
    _assert_rows(corr.keep_BT, [[1, 1, 0], [0, 0, 0]])


def test_veto_combines_with_rejection_and_is() -> None:
    """Token rejection at [0.4, 2.5] drops row 1's 3; a veto at 0.3 drops row 0 (its 1/4)."""
    corr = _correction(
        rollout_is="token",
        is_threshold=2.0,
        rollout_rs="token",
        rs_lower=0.4,
        rs_upper=2.5,
        veto_threshold=0.3,
    )
    _assert_rows(corr.token_weights_BT, [[0, 0, 0], [0, 0.5, 0]])


def test_a_vetoed_response_stays_in_the_denominator() -> None:
    """vanilla at ratio 1 (logp = old), token-mean: row 0 (2 tokens, A = 1) is vetoed, row 1
    (3 tokens, A = 2) kept, so the loss is (0 + 3 * -2) / 5, not -6 / 3."""
    logp_BT = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    rollout_BT = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # e^-5
    corr = compute_correction(
        logp_BT.detach(), rollout_BT, mask_BT, CorrectionSettings(veto_threshold=1e-2)
    )
    out = policy_loss(
        logp_BT,
        logp_BT.detach(),
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        mask_BT,
        token_weights_BT=corr.token_weights_BT,
    )
    assert out.loss.item() == pytest.approx(-6.0 / 5)


# ----------------------------------------------------------------------------- the loss


def _policy_batch() -> tuple[torch.Tensor, ...]:
    """8 rows of varied length, a third with advantage 0, a rollout policy off by ~0.4 nats."""
    gen = torch.Generator().manual_seed(3)
    lengths_B = torch.tensor([5, 1, 3, 4, 2, 5, 3, 4])
    mask_BT = (torch.arange(5)[None, :] < lengths_B[:, None]).to(torch.float64)
    old_BT = -torch.rand(8, 5, generator=gen, dtype=torch.float64) * 3
    logp_BT = old_BT + 0.3 * torch.randn(8, 5, generator=gen, dtype=torch.float64)
    rollout_BT = old_BT + 0.4 * torch.randn(8, 5, generator=gen, dtype=torch.float64)
    adv_B = torch.tensor([0.0, 1.2, -0.7, 0.0, 2.0, -1.5, 0.0, 0.4], dtype=torch.float64)
    return logp_BT, old_BT, rollout_BT, adv_B, mask_BT


SETTINGS = CorrectionSettings(rollout_is="sequence", is_threshold=1.5, rollout_rs="token")
VETO_SETTINGS = CorrectionSettings(rollout_is="token", veto_threshold=0.8)
"""With the seed of ``_policy_batch`` the veto drops rows 1, 2, 3, 6 and 7, with and without an
advantage, and keeps the others (``test_the_veto_case_vetoes_some_rows_with_an_advantage``)."""


def test_the_veto_case_vetoes_some_rows_with_an_advantage() -> None:
    _, old_BT, rollout_BT, adv_B, mask_BT = _policy_batch()
    keep_BT = compute_correction(old_BT, rollout_BT, mask_BT, VETO_SETTINGS).keep_BT
    vetoed = [b for b in range(8) if mask_BT[b].sum() > 0 and keep_BT[b].sum() == 0]
    assert vetoed == [1, 2, 3, 6, 7]
    assert any(adv_B[b] != 0 for b in vetoed) and any(adv_B[b] == 0 for b in vetoed)
    assert any(adv_B[b] != 0 for b in range(8) if b not in vetoed)


def _weighted_loss(
    pieces: list[list[int]],
    name: str,
    mode: str,
    denom: float | None,
    settings: CorrectionSettings = SETTINGS,
):
    logp_BT, old_BT, rollout_BT, adv_B, mask_BT = _policy_batch()
    leaf_BT = logp_BT.clone().requires_grad_(True)
    total = leaf_BT.new_zeros(())
    for rows in pieces:
        corr = compute_correction(old_BT[rows], rollout_BT[rows], mask_BT[rows], settings)
        total = (
            total
            + policy_loss(
                leaf_BT[rows],
                old_BT[rows],
                adv_B[rows],
                mask_BT[rows],
                0.2,
                0.2,
                mode,
                denom,
                loss=name,
                loss_scale_factor=6.0,
                token_weights_BT=corr.token_weights_BT,
                **loss_extras(name, old_BT, adv_B, mask_BT, rows),
            ).loss
        )
    total.backward()
    assert leaf_BT.grad is not None
    return total.detach(), leaf_BT.grad, adv_B, mask_BT


@pytest.mark.parametrize("settings", [SETTINGS, VETO_SETTINGS], ids=["is_rs", "veto"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_corrected_loss_is_split_and_prune_exact(
    name: str, mode: str, settings: CorrectionSettings
) -> None:
    """With the weights applied, any cut into pieces sharing the planner's normaliser (which
    counts rejected and vetoed tokens) sums to the unsplit loss and gradient, zero-advantage
    rows dropped or not, and their gradient is exactly 0."""
    whole, whole_grad, adv_B, mask_BT = _weighted_loss([list(range(8))], name, mode, None, settings)
    normaliser = normaliser_of(mask_BT.sum(dim=1).long().tolist(), mode, 6.0)
    assert (whole_grad[adv_B == 0] == 0).all()
    for pieces in ([[0, 1, 2], [3, 4, 5, 6, 7]], [[7], [2, 5], [0, 6, 1, 3, 4]]):
        split, split_grad, _, _ = _weighted_loss(pieces, name, mode, normaliser, settings)
        torch.testing.assert_close(split, whole)
        torch.testing.assert_close(split_grad, whole_grad)
    kept = [[b for b in rows if adv_B[b] != 0] for rows in ([1, 2, 4], [5, 7])]
    pruned, pruned_grad, _, _ = _weighted_loss(kept, name, mode, normaliser, settings)
    torch.testing.assert_close(pruned, whole)
    torch.testing.assert_close(pruned_grad, whole_grad)


def test_token_weights_multiply_each_tokens_loss_and_keep_the_denominator() -> None:
    """vanilla at ratio 1 (logp = old): loss per token is -A; token-mean over all 5 response
    tokens, rejected ones included: (-w1 - w2 - 0 - w4 - w5) * A / 5."""
    logp_BT = torch.zeros(1, 5, dtype=torch.float64, requires_grad=True)
    weights_BT = torch.tensor([[1.5, 1.0, 0.0, 0.25, 2.0]], dtype=torch.float64)
    out = policy_loss(
        logp_BT,
        logp_BT.detach(),
        torch.tensor([2.0]),
        torch.ones(1, 5),
        token_weights_BT=weights_BT,
    )
    assert out.loss.item() == pytest.approx(-2.0 * (1.5 + 1.0 + 0.25 + 2.0) / 5)
    out.loss.backward()
    assert logp_BT.grad is not None
    torch.testing.assert_close(logp_BT.grad, -2.0 * weights_BT / 5)


# ----------------------------------------------------------------------------- metrics


def test_metrics_of_a_known_injected_mismatch() -> None:
    """Engine log-probs shifted by +0.3 on even tokens and -1.0 on odd ones (rho = e^-0.3 and
    e^1): every metric follows from the two values."""
    old_BT = torch.full((2, 4), -1.5, dtype=torch.float64)
    shift_BT = torch.tensor([0.3, -1.0, 0.3, -1.0], dtype=torch.float64).expand(2, 4)
    settings = CorrectionSettings(rollout_is="token", rollout_rs="token")  # bounds [0.5, 2]
    m = mismatch_stats(old_BT, old_BT + shift_BT, torch.ones(2, 4), settings).metrics()
    lo, hi = math.exp(-0.3), math.e
    assert m["rollout_corr/kl"] == pytest.approx((0.3 - 1.0) / 2)
    assert m["rollout_corr/k3_kl"] == pytest.approx(((lo + 0.3 - 1) + (hi - 1.0 - 1)) / 2)
    assert m["rollout_corr/chi2_token"] == pytest.approx((lo**2 + hi**2) / 2 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((lo * hi) ** 4 - 1)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((lo + hi) / 2)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(hi)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(lo)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # no veto configured: verl reports its two fractions as 0
    assert m["rollout_corr/rollout_is_veto_fraction"] == 0.0
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == 0.0
    # ESS: weights e^-0.3 (inside [1/2, 2]) and e clamped to 2, four of each
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        (lo + 2.0) ** 2 / 2 / (lo**2 + 4.0)
    )
    assert set(m) == set(METRIC_NAMES)


def test_metrics_at_sequence_level_and_when_policies_agree() -> None:
    settings = CorrectionSettings(rollout_is="sequence", is_threshold=1.2)
    m = mismatch_stats(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, settings).metrics()
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((0.5 + 1.5) / 2)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(1.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    same = mismatch_stats(OLD_LOGP_BT, OLD_LOGP_BT, MASK_BT, settings).metrics()
    for name in ("kl", "k3_kl", "chi2_token", "chi2_seq"):
        assert same[f"rollout_corr/{name}"] == pytest.approx(0.0, abs=1e-12)
    assert same["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)


def _ess(weights: list[float]) -> float:
    """Effective sample size straight from verl's definition: ``1 / mean((w / mean(w))^2)``."""
    mean = sum(weights) / len(weights)
    return 1.0 / (sum((w / mean) ** 2 for w in weights) / len(weights))


def test_eff_sample_size_of_token_weights_by_hand() -> None:
    """Token ratios 2, 1, 1/4, 3, 1/2 clamped to [1/2, 2]: 2, 1, 1/2, 2, 1/2."""
    settings = CorrectionSettings(rollout_is="token", is_threshold=2.0)
    m = mismatch_stats(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, settings).metrics()
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        _ess([2.0, 1.0, 0.5, 2.0, 0.5])
    )
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(36 / 47.5)


def test_eff_sample_size_of_sequence_weights_counts_each_response_once() -> None:
    """Products 1/2 and 3/2 clamped to [1/1.2, 1.2]: one weight per response, whatever its
    length (verl would count the first three times and the second twice)."""
    settings = CorrectionSettings(rollout_is="sequence", is_threshold=1.2)
    m = mismatch_stats(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, settings).metrics()
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(_ess([1 / 1.2, 1.2]))


def test_eff_sample_size_is_one_for_uniform_weights() -> None:
    """Equal weights: every unit counts fully (a constant ratio e^0.4 on every token changes
    the scale of the weights, not their spread)."""
    settings = CorrectionSettings(rollout_is="token")
    shifted = mismatch_stats(ROLLOUT_LOGP_BT + 0.4, ROLLOUT_LOGP_BT, MASK_BT, settings)
    assert shifted.metrics()["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_veto_metrics_by_hand() -> None:
    """Threshold 0.6: tokens at 1/4 (row 0) and 1/2 (row 1) are catastrophic, 2 of 5 tokens,
    both responses vetoed; a padding slot's ratio never counts. Rejection's own fractions do
    not include the veto (verl keeps them apart)."""
    rollout_BT = ROLLOUT_LOGP_BT.clone()
    rollout_BT[1, 2] = 50.0  # padding slot at ratio e^-50
    settings = CorrectionSettings(veto_threshold=0.6, rollout_rs="token", rs_lower=0.2)
    m = mismatch_stats(OLD_LOGP_BT, rollout_BT, MASK_BT, settings).metrics()
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)  # the 3
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    only_row_0 = CorrectionSettings(veto_threshold=0.3)
    m = mismatch_stats(OLD_LOGP_BT, rollout_BT, MASK_BT, only_row_0).metrics()
    assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 2)


@pytest.mark.parametrize(
    "settings",
    [
        CorrectionSettings(rollout_rs="geometric", rs_lower=0.8, rs_upper=1.3),
        CorrectionSettings(rollout_is="token", veto_threshold=0.3),
    ],
)
def test_stats_merge_like_one_batch_and_survive_the_rows(settings: CorrectionSettings) -> None:
    """What the ranks do: sum rows, take the maximum of the max rows. The merged ESS and veto
    fraction are the whole batch's, not a mean of the ranks' values."""
    whole = mismatch_stats(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, settings)
    parts = [
        mismatch_stats(OLD_LOGP_BT[[r]], ROLLOUT_LOGP_BT[[r]], MASK_BT[[r]], settings)
        for r in (0, 1)
    ]
    merged = parts[0] + parts[1]
    assert merged.metrics() == pytest.approx(whole.metrics())
    ess = "rollout_corr/rollout_is_eff_sample_size"
    mean_of_parts = (parts[0].metrics()[ess] + parts[1].metrics()[ess]) / 2
    assert merged.metrics()[ess] != pytest.approx(mean_of_parts)
    assert MismatchStats.from_row(whole.to_row(), whole.max_row()) == whole
    assert MismatchStats() + whole == whole


def test_stats_of_sequences_equal_the_padded_batch() -> None:
    old = {4: OLD_LOGP_BT[0], 9: OLD_LOGP_BT[1, :2]}
    rollout = {4: ROLLOUT_LOGP_BT[0], 9: ROLLOUT_LOGP_BT[1, :2], 5: torch.zeros(7)}
    settings = CorrectionSettings(rollout_rs="token")
    got = mismatch_stats_of_sequences(old, rollout, settings)
    assert got == mismatch_stats(OLD_LOGP_BT, ROLLOUT_LOGP_BT, MASK_BT, settings)
    assert math.isnan(mismatch_stats_of_sequences({}, {}, settings).metrics()["rollout_corr/kl"])

"""PPO loss, aggregation, KL penalties and logit helpers against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo.losses import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs_from_logits,
)

# ----------------------------------------------------------------------------- aggregate

VALUES_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_token_mean_hand_computed() -> None:
    assert aggregate(VALUES_BT, MASK_BT, "token-mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_sum_hand_computed() -> None:
    # per-sequence sums 3 and 4, mean over 2 sequences
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum").item() == pytest.approx(3.5)


def test_explicit_denom_overrides_default() -> None:
    assert aggregate(VALUES_BT, MASK_BT, "token-mean", denom=14.0).item() == pytest.approx(0.5)
    denom = torch.tensor(7.0)
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum", denom).item() == pytest.approx(1.0)


def test_bool_mask_equals_float_mask() -> None:
    for mode in ("token-mean", "seq-mean-token-sum"):
        torch.testing.assert_close(
            aggregate(VALUES_BT, MASK_BT.bool(), mode), aggregate(VALUES_BT, MASK_BT, mode)
        )


def test_unknown_mode_lists_valid_modes() -> None:
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate(VALUES_BT, MASK_BT, "seq-mean")


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="same shape"):
        aggregate(VALUES_BT, MASK_BT[:, :2], "token-mean")


@pytest.mark.parametrize("denom", [None, 0.0, 0, torch.tensor(0.0)])
def test_zero_denom_returns_zero_that_carries_the_graph(denom: float | torch.Tensor | None) -> None:
    values_BT = VALUES_BT.clone().requires_grad_(True)
    mask_BT = torch.zeros_like(MASK_BT) if denom is None else MASK_BT
    out = aggregate(values_BT, mask_BT, "token-mean", denom)
    assert out.item() == 0.0
    assert out.requires_grad
    out.backward()
    assert torch.equal(values_BT.grad, torch.zeros_like(VALUES_BT))


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values_BT = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    lengths_B = torch.tensor([5, 1, 3, 4, 2, 5, 3])
    mask_BT = (torch.arange(5)[None, :] < lengths_B[:, None]).to(torch.float64)
    return values_BT, mask_BT


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("cuts", [[3], [2, 3], [1, 5]])
def test_split_with_global_denom_equals_unsplit(mode: str, cuts: list[int]) -> None:
    values_BT, mask_BT = _random_batch(seed=1)
    whole_values_BT = values_BT.clone().requires_grad_(True)
    whole = aggregate(whole_values_BT, mask_BT, mode)
    whole.backward()

    global_denom = mask_BT.sum() if mode == "token-mean" else float(mask_BT.shape[0])
    split_values_BT = values_BT.clone().requires_grad_(True)
    pieces = zip(
        torch.tensor_split(split_values_BT, cuts), torch.tensor_split(mask_BT, cuts), strict=True
    )
    summed = sum(aggregate(v_BT, m_BT, mode, global_denom) for v_BT, m_BT in pieces)
    summed.backward()

    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(split_values_BT.grad, whole_values_BT.grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_split_with_local_denoms_does_not_equal_unsplit(mode: str) -> None:
    """Why the global denom is needed: averaging per-piece means weights tokens unevenly."""
    values_BT, mask_BT = _random_batch(seed=1)
    whole = aggregate(values_BT, mask_BT, mode)
    cuts = [2, 3]
    local_means = [
        aggregate(v_BT, m_BT, mode)
        for v_BT, m_BT in zip(
            torch.tensor_split(values_BT, cuts), torch.tensor_split(mask_BT, cuts), strict=True
        )
    ]
    mean_of_means = sum(local_means) / len(local_means)
    assert not torch.allclose(mean_of_means, whole)


# ----------------------------------------------------------------------------- policy_loss


def _single_tokens(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 1] logp (requiring grad) and old_logp = 0 so that exp(logp - old_logp) = ratio."""
    logp_BT = torch.tensor(ratios, dtype=torch.float64).log().unsqueeze(-1).requires_grad_(True)
    return logp_BT, torch.zeros_like(logp_BT)


@pytest.mark.parametrize(
    ("ratio", "adv", "expected_loss", "expected_clipfrac", "expected_grad"),
    [
        # A > 0, ratio above 1 + eps: the clipped -A * 1.2 is the max, gradient 0
        (1.5, 1.0, -1.2, 1.0, 0.0),
        # A < 0, ratio above 1 + eps: unclipped -A * 1.5 = 1.5 wins, grad = -A * ratio
        (1.5, -1.0, 1.5, 0.0, 1.5),
        # A > 0, ratio below 1 - eps: unclipped -0.5 wins (pessimistic), grad = -A * ratio
        (0.5, 1.0, -0.5, 0.0, -0.5),
        # A < 0, ratio below 1 - eps: clipped -A * 0.8 = 0.8 wins, gradient 0
        (0.5, -1.0, 0.8, 1.0, 0.0),
        # inside the trust region: plain -A * ratio
        (1.1, 2.0, -2.2, 0.0, -2.2),
    ],
)
def test_policy_loss_single_token_cases(
    ratio: float, adv: float, expected_loss: float, expected_clipfrac: float, expected_grad: float
) -> None:
    logp_BT, old_logp_BT = _single_tokens([ratio])
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([adv]), torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(expected_loss)
    assert out.clipfrac.item() == expected_clipfrac
    out.loss.backward()
    assert logp_BT.grad.item() == pytest.approx(expected_grad)


def test_policy_loss_batch_hand_computed() -> None:
    logp_BT, old_logp_BT = _single_tokens([1.5, 1.5, 0.5, 0.5])
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4, 1))
    # per-token losses -1.2, 1.5, -0.5, 0.8
    assert out.loss.item() == pytest.approx(0.6 / 4)
    assert out.clipfrac.item() == pytest.approx(0.5)
    # mean of old - logp = mean(-ln 1.5, -ln 1.5, ln 2, ln 2)
    assert out.ppo_kl.item() == pytest.approx(0.5 * math.log(4 / 3))
    assert not out.clipfrac.requires_grad and not out.ppo_kl.requires_grad
    assert out.loss.requires_grad


def test_clip_high_is_separate_from_clip_low() -> None:
    logp_BT, old_logp_BT = _single_tokens([1.5, 0.5])
    out = policy_loss(
        logp_BT,
        old_logp_BT,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 1),
        clip_low=0.1,
        clip_high=0.28,
    )
    # -1 * 1.28 and +1 * 0.9
    assert out.loss.item() == pytest.approx((-1.28 + 0.9) / 2)


def test_masked_tokens_do_not_count_and_get_no_gradient() -> None:
    logp_BT = torch.log(torch.tensor([[1.5, 1.0, 3.0]], dtype=torch.float64)).requires_grad_(True)
    out = policy_loss(
        logp_BT, torch.zeros_like(logp_BT), torch.tensor([-1.0]), torch.tensor([[1, 1, 0]])
    )
    assert out.loss.item() == pytest.approx((1.5 + 1.0) / 2)
    assert out.clipfrac.item() == 0.0
    out.loss.backward()
    assert logp_BT.grad[0, 2].item() == 0.0
    assert logp_BT.grad[0, 0].item() == pytest.approx(1.5 / 2)


def test_per_sequence_advantage_broadcasts_like_per_token() -> None:
    gen = torch.Generator().manual_seed(3)
    logp_BT = -torch.rand(3, 4, generator=gen)
    old_logp_BT = -torch.rand(3, 4, generator=gen)
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv_B = torch.tensor([0.7, -1.3, 2.0])
    per_seq = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, agg="seq-mean-token-sum")
    per_token = policy_loss(
        logp_BT, old_logp_BT, adv_B[:, None].expand(3, 4), mask_BT, agg="seq-mean-token-sum"
    )
    torch.testing.assert_close(per_seq.loss, per_token.loss)
    torch.testing.assert_close(per_seq.clipfrac, per_token.clipfrac)


def test_zero_advantage_tokens_contribute_exactly_zero() -> None:
    gen = torch.Generator().manual_seed(4)
    old_logp_BT = -torch.rand(2, 3, generator=gen) * 3
    # within the trust region, so the non-zero-advantage sequence does get a gradient
    logp_BT = (old_logp_BT + 0.1 * torch.rand(2, 3, generator=gen) - 0.05).requires_grad_(True)
    mask_BT = torch.ones(2, 3)
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([0.0, 1.0]), mask_BT, denom=6.0)
    out.loss.backward()
    assert torch.equal(logp_BT.grad[0], torch.zeros(3))
    assert (logp_BT.grad[1] != 0).any()

    # moving the zero-advantage sequence's log-probs anywhere leaves the loss bit-identical
    moved_logp_BT = logp_BT.detach().clone()
    moved_logp_BT[0] += 5.0
    moved = policy_loss(moved_logp_BT, old_logp_BT, torch.tensor([0.0, 1.0]), mask_BT, denom=6.0)
    assert moved.loss.item() == out.loss.item()

    all_zero = policy_loss(logp_BT, old_logp_BT, torch.zeros(2), mask_BT)
    assert all_zero.loss.item() == 0.0


def test_extreme_log_ratio_stays_finite() -> None:
    logp_BT = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old_logp_BT = torch.tensor([[-200.0, -1.0]])
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([-1.0]), torch.ones(1, 2))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp_BT.grad).all()


def test_policy_loss_rejects_wrong_advantage_length() -> None:
    logp_BT = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="per-sequence advantages"):
        policy_loss(logp_BT, logp_BT, torch.zeros(3), torch.ones(2, 3))


# ----------------------------------------------------------------------------- kl_penalty

LOGP_BT = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
REF_LOGP_BT = torch.tensor([[math.log(0.25)]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", math.log(2)),
        ("k2", 0.5 * math.log(2) ** 2),
        # exp(-ln 2) + ln 2 - 1
        ("k3", math.log(2) - 0.5),
        ("low_var_kl", math.log(2) - 0.5),
    ],
)
def test_kl_penalty_hand_computed(kind: str, expected: float) -> None:
    assert kl_penalty(LOGP_BT, REF_LOGP_BT, kind).item() == pytest.approx(expected)


def test_k1_is_signed_k3_is_not() -> None:
    # swapping roles: ref more likely than policy
    assert kl_penalty(REF_LOGP_BT, LOGP_BT, "k1").item() == pytest.approx(-math.log(2))
    # exp(ln 2) - ln 2 - 1
    assert kl_penalty(REF_LOGP_BT, LOGP_BT, "k3").item() == pytest.approx(1 - math.log(2))


def test_low_var_kl_is_clamped_but_k3_is_not() -> None:
    logp_BT = torch.tensor([[0.0]])
    ref_logp_BT = torch.tensor([[3.0]])  # exp(3) - 3 - 1 = 16.0855...
    assert kl_penalty(logp_BT, ref_logp_BT, "k3").item() == pytest.approx(math.exp(3) - 4)
    assert kl_penalty(logp_BT, ref_logp_BT, "low_var_kl").item() == 10.0


def test_kl_penalties_vanish_when_policies_agree() -> None:
    logp_BT = torch.tensor([[-0.3, -2.0]])
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(kl_penalty(logp_BT, logp_BT, kind), torch.zeros(1, 2))


def test_unknown_kl_kind_lists_valid_kinds() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        kl_penalty(LOGP_BT, REF_LOGP_BT, "mse")


# ----------------------------------------------------------------------------- logits


def test_entropy_hand_computed() -> None:
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # p = [1/4, 3/4] and uniform
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(
        entropy_from_logits(logits_BTV), torch.tensor([[expected, math.log(2)]])
    )


def test_entropy_stable_for_huge_and_minus_inf_logits() -> None:
    logits_BTV = torch.tensor([[[1e4, 1e4, 1e4, 1e4], [0.0, 0.0, -math.inf, -math.inf]]])
    logits_BTV.requires_grad_(True)
    entropy_BT = entropy_from_logits(logits_BTV)
    torch.testing.assert_close(entropy_BT, torch.tensor([[math.log(4), math.log(2)]]))
    entropy_BT.sum().backward()
    assert torch.isfinite(logits_BTV.grad).all()


def test_entropy_upcasts_bfloat16() -> None:
    logits_BTV = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(5))
    entropy_BT = entropy_from_logits(logits_BTV.bfloat16())
    assert entropy_BT.dtype == torch.float32
    torch.testing.assert_close(
        entropy_BT, entropy_from_logits(logits_BTV.bfloat16().float()), rtol=0, atol=0
    )


def test_token_logprobs_hand_computed_with_temperature() -> None:
    logits_BTV = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64)
    tokens_BT = torch.tensor([[1]])
    assert token_logprobs_from_logits(logits_BTV, tokens_BT).item() == pytest.approx(math.log(0.75))
    # temperature 2 halves the logits: p = sqrt(3) / (1 + sqrt(3))
    assert token_logprobs_from_logits(logits_BTV, tokens_BT, temperature=2.0).item() == (
        pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))
    )


def test_token_logprobs_match_log_softmax_gather() -> None:
    gen = torch.Generator().manual_seed(6)
    logits_BTV = torch.randn(3, 4, 17, generator=gen) * 5
    tokens_BT = torch.randint(0, 17, (3, 4), generator=gen)
    expected_BT = torch.log_softmax(logits_BTV / 0.7, dim=-1).gather(-1, tokens_BT[..., None])
    torch.testing.assert_close(
        token_logprobs_from_logits(logits_BTV, tokens_BT, temperature=0.7), expected_BT[..., 0]
    )


def test_token_logprobs_rejects_bad_temperature_and_shapes() -> None:
    logits_BTV = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_from_logits(logits_BTV, torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs_from_logits(logits_BTV, torch.zeros(1, 3, dtype=torch.long))

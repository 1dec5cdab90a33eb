"""PPO loss, aggregation, KL penalties and logit helpers against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.policy_losses import loss_extras

from megarl.algo.losses import (
    AGG_MODES,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs_from_logits,
)
from megarl.algo.policy_losses import (
    COVARIANCE_LOSSES,
    POLICY_LOSS_NAMES,
    POLICY_LOSSES,
    get_policy_loss,
)
from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import LOSS_AGG_MODES, PlannerInputs
from megarl.planner.optimizer_steps import normaliser_of

# ----------------------------------------------------------------------------- aggregate

VALUES_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_BT = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_token_mean_hand_computed() -> None:
    assert aggregate(VALUES_BT, MASK_BT, "token-mean").item() == pytest.approx(7 / 3)


def test_seq_mean_token_sum_hand_computed() -> None:
    # per-sequence sums 3 and 4, mean over 2 sequences
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum").item() == pytest.approx(3.5)


def test_seq_mean_token_mean_hand_computed() -> None:
    # per-sequence token means (1 + 2) / 2 = 1.5 and 4 / 1 = 4, mean over 2 sequences
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-mean").item() == pytest.approx(2.75)


def test_seq_mean_token_sum_norm_hand_computed() -> None:
    # Dr. GRPO: per-sequence sums 3 and 4 over the constant, averaged over 2 sequences
    got = aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum-norm", loss_scale_factor=4.0)
    assert got.item() == pytest.approx((3 + 4) / (2 * 4))
    # no constant: the padded length T = 3, as verl's default
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)


def test_seq_mean_token_mean_keeps_a_row_weight_and_ignores_empty_rows() -> None:
    """A weighted mask (a filler row at 0) weighs the row's mean; an all-zero row adds 0."""
    mask_BT = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    got = aggregate(VALUES_BT, mask_BT, "seq-mean-token-mean", denom=1.0)
    assert got.item() == pytest.approx(0.5 * 1.5)


def test_agg_modes_are_the_planners() -> None:
    assert AGG_MODES == LOSS_AGG_MODES


def test_explicit_denom_overrides_default() -> None:
    assert aggregate(VALUES_BT, MASK_BT, "token-mean", denom=14.0).item() == pytest.approx(0.5)
    denom = torch.tensor(7.0)
    assert aggregate(VALUES_BT, MASK_BT, "seq-mean-token-sum", denom).item() == pytest.approx(1.0)


def test_bool_mask_equals_float_mask() -> None:
    for mode in AGG_MODES:
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


def _aggregate_by_hand(values_BT: torch.Tensor, lengths: list[int], mode: str, scale: float):
    """The four aggregations as loops over sequences, written from their definitions."""
    seq_sums = [values_BT[b, :n].sum() for b, n in enumerate(lengths)]
    if mode == "token-mean":
        return sum(seq_sums) / sum(lengths)
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / len(lengths)
    if mode == "seq-mean-token-mean":
        return sum(total / n for total, n in zip(seq_sums, lengths, strict=True)) / len(lengths)
    return sum(seq_sums) / (len(lengths) * scale)  # Dr. GRPO: sums over a constant, seq-mean


@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_aggregation_matches_its_definition(mode: str) -> None:
    values_BT, mask_BT = _random_batch(seed=2)
    lengths = mask_BT.sum(dim=1).long().tolist()
    got = aggregate(values_BT, mask_BT, mode, loss_scale_factor=16.0)
    torch.testing.assert_close(got, _aggregate_by_hand(values_BT, lengths, mode, 16.0))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("cuts", [[3], [2, 3], [1, 5]])
def test_split_with_global_denom_equals_unsplit(mode: str, cuts: list[int]) -> None:
    values_BT, mask_BT = _random_batch(seed=1)
    whole_values_BT = values_BT.clone().requires_grad_(True)
    whole = aggregate(whole_values_BT, mask_BT, mode, loss_scale_factor=16.0)
    whole.backward()

    # the planner's normaliser of the whole batch
    global_denom = normaliser_of(mask_BT.sum(dim=1).long().tolist(), mode, 16.0)
    split_values_BT = values_BT.clone().requires_grad_(True)
    pieces = zip(
        torch.tensor_split(split_values_BT, cuts), torch.tensor_split(mask_BT, cuts), strict=True
    )
    summed = sum(aggregate(v_BT, m_BT, mode, global_denom) for v_BT, m_BT in pieces)
    summed.backward()

    torch.testing.assert_close(summed, whole)
    torch.testing.assert_close(split_values_BT.grad, whole_values_BT.grad)


@pytest.mark.parametrize("mode", AGG_MODES)
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


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_zero_advantage_tokens_contribute_exactly_zero(name: str, mode: str) -> None:
    gen = torch.Generator().manual_seed(4)
    old_logp_BT = -torch.rand(2, 3, generator=gen) * 3
    # within the trust region, so the non-zero-advantage sequence does get a gradient
    logp_BT = (old_logp_BT + 0.1 * torch.rand(2, 3, generator=gen) - 0.05).requires_grad_(True)
    mask_BT = torch.ones(2, 3)
    extras = loss_extras(name, old_logp_BT, torch.tensor([0.0, 1.0]), mask_BT)
    kwargs = {"agg": mode, "denom": 6.0, "loss": name, **extras}
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([0.0, 1.0]), mask_BT, **kwargs)
    out.loss.backward()
    assert torch.equal(logp_BT.grad[0], torch.zeros(3))
    assert (logp_BT.grad[1] != 0).any()

    # moving the zero-advantage sequence's log-probs anywhere (even to an overflowing ratio)
    # leaves the loss bit-identical
    for shift in (5.0, 100.0, -100.0):
        moved_logp_BT = logp_BT.detach().clone()
        moved_logp_BT[0] += shift
        moved = policy_loss(moved_logp_BT, old_logp_BT, torch.tensor([0.0, 1.0]), mask_BT, **kwargs)
        assert moved.loss.item() == out.loss.item()

    zeros = torch.zeros(2)
    extras = loss_extras(name, old_logp_BT, zeros, mask_BT)
    all_zero = policy_loss(logp_BT, old_logp_BT, zeros, mask_BT, agg=mode, loss=name, **extras)
    assert all_zero.loss.item() == 0.0


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_extreme_log_ratio_stays_finite(name: str) -> None:
    logp_BT = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old_logp_BT = torch.tensor([[-200.0, -1.0]])
    extras = loss_extras(name, old_logp_BT, torch.tensor([-1.0]), torch.ones(1, 2))
    out = policy_loss(
        logp_BT, old_logp_BT, torch.tensor([-1.0]), torch.ones(1, 2), loss=name, **extras
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp_BT.grad).all()


def test_policy_loss_rejects_wrong_advantage_length() -> None:
    logp_BT = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="per-sequence advantages"):
        policy_loss(logp_BT, logp_BT, torch.zeros(3), torch.ones(2, 3))


# ----------------------------------------------------------------------------- policy losses


def test_registry_names_and_default_aggregations() -> None:
    assert POLICY_LOSS_NAMES == (
        "vanilla",
        "gspo",
        "cispo",
        "sft",
        "dppo_tv",
        "dppo_kl",
        "prime_dppo",
        "geo_mean",
        "sapo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "m2po",
    )
    assert COVARIANCE_LOSSES == ("clip_cov", "kl_cov")
    assert all(entry.default_agg in AGG_MODES for entry in POLICY_LOSSES.values())
    assert get_policy_loss("gspo").default_agg == "seq-mean-token-mean"  # as verl forces it
    with pytest.raises(ValueError, match="vanilla, gspo, cispo, sft"):
        get_policy_loss("ppo")


@pytest.mark.parametrize(
    ("ratio", "adv", "expected_loss", "expected_lower", "expected_grad"),
    [
        # A < 0, ratio 5 > c = 3: PPO's max(5, 0.8) = 5 is bounded by -A * c = 3, gradient 0
        (5.0, -1.0, 3.0, 1.0, 0.0),
        # A = -2, ratio 4: max(8, 1.6) = 8 bounded by 6
        (4.0, -2.0, 6.0, 1.0, 0.0),
        # A < 0, ratio 2 < c: the dual clip is not active, grad = -A * ratio
        (2.0, -1.0, 2.0, 0.0, 2.0),
        # A > 0: never dual-clipped, the usual clip at 1 + 0.2
        (5.0, 1.0, -1.2, 0.0, 0.0),
    ],
)
def test_dual_clip_by_hand(
    ratio: float, adv: float, expected_loss: float, expected_lower: float, expected_grad: float
) -> None:
    logp_BT, old_logp_BT = _single_tokens([ratio])
    out = policy_loss(logp_BT, old_logp_BT, torch.tensor([adv]), torch.ones(1, 1), clip_ratio_c=3)
    assert out.loss.item() == pytest.approx(expected_loss)
    assert out.clipfrac_lower.item() == expected_lower
    out.loss.backward()
    assert logp_BT.grad.item() == pytest.approx(expected_grad)


def test_dual_clip_matches_the_papers_objective_on_a_batch() -> None:
    """Ye et al. 2020 (arXiv:1912.09729) eq. 5, as an objective to maximise:
    ``A < 0: max(min(r A, clip(r) A), c A)``, else ``min(r A, clip(r) A)``."""
    gen = torch.Generator().manual_seed(11)
    old_logp_BT = -torch.rand(6, 4, generator=gen, dtype=torch.float64) * 2
    logp_BT = (old_logp_BT + torch.randn(6, 4, generator=gen, dtype=torch.float64)).detach()
    adv_B = torch.tensor([-1.5, -0.3, 0.7, 2.0, -2.5, 1.0], dtype=torch.float64)
    mask_BT = (torch.arange(4)[None, :] < torch.tensor([4, 2, 3, 1, 4, 3])[:, None]).double()
    c, low, high = 2.0, 0.2, 0.28

    r = torch.exp(logp_BT - old_logp_BT)
    a = adv_B[:, None]
    ppo = torch.minimum(r * a, r.clamp(1 - low, 1 + high) * a)
    objective = torch.where(a < 0, torch.maximum(ppo, c * a), ppo)
    expected = -(objective * mask_BT).sum() / mask_BT.sum()

    out = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, low, high, clip_ratio_c=c)
    torch.testing.assert_close(out.loss, expected)
    dual_active = (a < 0) & (ppo < c * a)
    assert dual_active[mask_BT.bool()].any(), "no token reaches the dual clip"
    torch.testing.assert_close(out.clipfrac_lower, (dual_active * mask_BT).sum() / mask_BT.sum())


def _gspo_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three sequences of 3, 2 and 4 tokens, with per-token log-ratios far from their mean."""
    old_logp_BT = torch.tensor(
        [[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.2, 0.0, 0.0], [-2.0, -0.1, -0.7, -1.5]],
        dtype=torch.float64,
    )
    log_ratio_BT = torch.tensor(
        [[0.3, -0.1, 0.1, 0.0], [-0.02, 0.01, 0.0, 0.0], [0.5, -0.4, 0.2, -0.1]],
        dtype=torch.float64,
    )
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    adv_B = torch.tensor([1.0, -0.5, -2.0], dtype=torch.float64)
    return old_logp_BT + log_ratio_BT, old_logp_BT, adv_B, mask_BT


def test_gspo_matches_the_sequence_level_objective_and_its_gradient() -> None:
    """GSPO (arXiv:2507.18071) eq. 5 with eq. 7's ratio: ``J = 1/G sum_i min(s_i A_i,
    clip(s_i, 1 - low, 1 + high) A_i)``, ``s_i = exp(1/|y_i| sum_t log(pi / pi_old))``; autograd
    of J written this way is eq. 10's gradient, which the token-level form must reproduce."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _gspo_batch()
    low, high = 0.05, 0.04
    # sequence means of the log-ratio: 0.1, -0.005, 0.05; s_0 = e^0.1 > 1.04 with A > 0 clips
    ref_logp_BT = logp_BT.clone().requires_grad_(True)
    s_B = torch.exp(((ref_logp_BT - old_logp_BT) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1))
    objective_B = torch.minimum(s_B * adv_B, s_B.clamp(1 - low, 1 + high) * adv_B)
    expected = -objective_B.mean()
    expected.backward()

    got_logp_BT = logp_BT.clone().requires_grad_(True)
    out = policy_loss(
        got_logp_BT, old_logp_BT, adv_B, mask_BT, low, high, "seq-mean-token-mean", loss="gspo"
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(got_logp_BT.grad, ref_logp_BT.grad)
    assert (got_logp_BT.grad[0] == 0).all() and (got_logp_BT.grad[2, :4] != 0).all()
    # clipped: sequence 0's 3 tokens of 9
    assert out.clipfrac.item() == pytest.approx(3 / 9)
    assert out.clipfrac_lower.item() == 0.0


def test_gspo_ratio_is_the_sequences_on_every_token() -> None:
    """``s_i,t = sg[s_i] * pi / sg[pi]`` (eq. 13): value s_i, gradient s_i * grad log pi."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _gspo_batch()
    logp_BT.requires_grad_(True)
    out = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, 0.9, 0.9, "seq-mean-token-sum")
    gspo = policy_loss(
        logp_BT, old_logp_BT, adv_B, mask_BT, 0.9, 0.9, "seq-mean-token-sum", loss="gspo"
    )
    (grad_BT,) = torch.autograd.grad(gspo.loss, logp_BT)
    s_B = torch.exp(((logp_BT - old_logp_BT) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1))
    # nothing clipped at +-0.9: per token -A * s_i, summed per sequence, mean over 3
    expected_loss = -(adv_B * s_B * mask_BT.sum(dim=1)).sum() / 3
    torch.testing.assert_close(gspo.loss, expected_loss)
    torch.testing.assert_close(grad_BT, (-adv_B * s_B)[:, None] * mask_BT / 3)
    assert not torch.allclose(gspo.loss, out.loss)  # vanilla's token ratios differ


def test_gspo_ignores_padding_and_other_rows() -> None:
    """A sequence's ratio reads only its own masked tokens: padding values do not matter."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _gspo_batch()
    moved_logp_BT = logp_BT + (1 - mask_BT) * 7.0
    first = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, loss="gspo")
    second = policy_loss(moved_logp_BT, old_logp_BT, adv_B, mask_BT, loss="gspo")
    assert first.loss.item() == second.loss.item()


def _toy_policy_logprobs(weight_VH: torch.Tensor) -> torch.Tensor:
    """Log-probs of fixed sampled tokens under a toy linear policy ``softmax(h W^T)``: the
    "model forward" of the old-logprob tests (3 sequences, 4 slots, vocabulary 5)."""
    hidden_BTH = torch.linspace(-1.0, 1.0, 3 * 4 * 2, dtype=torch.float64).reshape(3, 4, 2)
    tokens_BT = torch.tensor([[0, 3, 1, 4], [2, 2, 0, 0], [4, 1, 3, 0]])
    logp_BTV = torch.log_softmax(hidden_BTH @ weight_VH.T, dim=-1)
    return logp_BTV.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)


def _gspo_step(weight_VH: torch.Tensor, old_of) -> tuple[torch.Tensor, torch.Tensor]:
    """One GSPO training forward on ``weight_VH``: the loss and its gradient in the weights,
    with the old log-probs ``old_of(train_logp_BT)`` (the forward's own, or provided ones)."""
    _, _, adv_B, mask_BT = _gspo_batch()
    leaf_VH = weight_VH.clone().requires_grad_(True)
    logp_BT = _toy_policy_logprobs(leaf_VH)
    out = policy_loss(
        logp_BT, old_of(logp_BT), adv_B, mask_BT, 0.2, 0.2, "seq-mean-token-mean", loss="gspo"
    )
    (grad_VH,) = torch.autograd.grad(out.loss, leaf_VH)
    return out.loss.detach(), grad_VH


def test_gspo_first_slice_train_forward_old_equals_recomputed_old() -> None:
    """The gates let the first slice take its old log-probs from the training forward
    (detached) instead of recomputing them: the weights have not moved, so GSPO's sequence
    ratio, loss and gradient are the same, per whole row or row by row (as the actor picks a
    source per sequence). Reference: at pi = pi_old every s_i = 1 (GSPO eq. 7), so the loss is
    ``-1/G sum_i A_i`` and the gradient is eq. 10's ``-1/G sum_i A_i / |y_i| sum_t grad log pi``."""
    weight_VH = torch.tensor(
        [[0.5, -1.0], [1.5, 0.2], [-0.7, 0.9], [0.1, 0.4], [-1.2, -0.3]], dtype=torch.float64
    )
    with torch.no_grad():  # the old-logprob pass: a separate forward on the same weights
        recomputed_BT = _toy_policy_logprobs(weight_VH.clone())
    train_loss, train_grad = _gspo_step(weight_VH, lambda logp_BT: logp_BT.detach())
    re_loss, re_grad = _gspo_step(weight_VH, lambda _: recomputed_BT)
    first_row_recomputed = torch.tensor([True, False, False])[:, None]
    mixed_loss, mixed_grad = _gspo_step(
        weight_VH,
        lambda logp_BT: torch.where(first_row_recomputed, recomputed_BT, logp_BT.detach()),
    )
    for loss, grad in ((re_loss, re_grad), (mixed_loss, mixed_grad)):
        torch.testing.assert_close(loss, train_loss, rtol=0, atol=1e-15)
        torch.testing.assert_close(grad, train_grad, rtol=0, atol=1e-15)

    _, _, adv_B, mask_BT = _gspo_batch()
    assert train_loss.item() == pytest.approx(-adv_B.mean().item())
    leaf_VH = weight_VH.clone().requires_grad_(True)
    per_seq_mean_B = (_toy_policy_logprobs(leaf_VH) * mask_BT).sum(dim=1) / mask_BT.sum(dim=1)
    (expected_grad,) = torch.autograd.grad(-(adv_B * per_seq_mean_B).mean(), leaf_VH)
    torch.testing.assert_close(train_grad, expected_grad)

    # the check can tell: old log-probs of moved (stale) weights give another loss
    with torch.no_grad():
        stale_BT = _toy_policy_logprobs(weight_VH * 1.3)
    stale_loss, _ = _gspo_step(weight_VH, lambda _: stale_BT)
    assert stale_loss.item() != pytest.approx(train_loss.item())


def test_cispo_matches_the_papers_objective_and_stop_gradient() -> None:
    """CISPO (arXiv:2506.13585) eq. 4 with token-mean: ``J = 1/sum|o_i| sum_i sum_t
    sg(r_hat_i,t) A_i log pi_i,t``, ``r_hat = clip(r, 1 - low, 1 + high)`` (eq. 5). The weight
    is detached, so d(-J)/d log pi_i,t = -r_hat_i,t A_i / N even where r is clipped."""
    logp_BT, old_logp_BT = _single_tokens([1.5, 0.5, 1.1, 0.9])
    adv_B = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    out = policy_loss(logp_BT, old_logp_BT, adv_B, torch.ones(4, 1), 0.2, 0.28, loss="cispo")
    r_hat = torch.tensor([1.28, 0.8, 1.1, 0.9], dtype=torch.float64)
    log_pi = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.9], dtype=torch.float64))
    expected_loss = -(r_hat * adv_B * log_pi).sum() / 4
    assert out.loss.item() == pytest.approx(expected_loss.item())
    out.loss.backward()
    torch.testing.assert_close(logp_BT.grad[:, 0], -r_hat * adv_B / 4)
    assert out.clipfrac.item() == pytest.approx(0.5)  # ratios 1.5 and 0.5 are clipped

    # where vanilla PPO zeroes a clipped token's gradient, CISPO keeps it
    ppo_logp_BT = logp_BT.detach().clone().requires_grad_(True)
    policy_loss(ppo_logp_BT, old_logp_BT, adv_B, torch.ones(4, 1), 0.2, 0.28).loss.backward()
    assert ppo_logp_BT.grad[0].item() == 0.0 and logp_BT.grad[0].item() != 0.0


def test_cispo_without_lower_bound() -> None:
    """MiniMax-M1 sets no lower bound (verl's example: clip_ratio_low=10)."""
    logp_BT, old_logp_BT = _single_tokens([0.1])
    out = policy_loss(
        logp_BT, old_logp_BT, torch.tensor([-1.0]), torch.ones(1, 1), 10.0, 0.2, loss="cispo"
    )
    out.loss.backward()
    assert logp_BT.grad.item() == pytest.approx(0.1)  # the unclipped weight r = 0.1
    assert out.clipfrac.item() == 0.0


def _policy_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 sequences of varied length, a third with advantage 0, ratios around the clip range."""
    gen = torch.Generator().manual_seed(seed)
    lengths_B = torch.tensor([5, 1, 3, 4, 2, 5, 3, 4])
    mask_BT = (torch.arange(5)[None, :] < lengths_B[:, None]).to(torch.float64)
    old_logp_BT = -torch.rand(8, 5, generator=gen, dtype=torch.float64) * 3
    logp_BT = old_logp_BT + 0.3 * torch.randn(8, 5, generator=gen, dtype=torch.float64)
    adv_B = torch.tensor([0.0, 1.2, -0.7, 0.0, 2.0, -1.5, 0.0, 0.4], dtype=torch.float64)
    return logp_BT, old_logp_BT, adv_B, mask_BT


def _loss_and_grad(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    pieces: list[list[int]],
    name: str,
    mode: str,
    denom: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``policy_loss`` over row ``pieces`` (all with ``denom``), and its gradient."""
    leaf_BT = logp_BT.clone().requires_grad_(True)
    total = sum(
        policy_loss(
            leaf_BT[rows],
            old_logp_BT[rows],
            adv_B[rows],
            mask_BT[rows],
            0.1,
            0.15,
            mode,
            denom,
            loss=name,
            clip_ratio_c=1.5,
            loss_scale_factor=6.0,
            **loss_extras(name, old_logp_BT, adv_B, mask_BT, rows),
        ).loss
        for rows in pieces
    )
    assert isinstance(total, torch.Tensor)
    total.backward()
    assert leaf_BT.grad is not None
    return total.detach(), leaf_BT.grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_split_and_pruned_equal_unsplit_for_every_loss_and_aggregation(
    name: str, mode: str
) -> None:
    """Any cut into micro-batches / DP shards (rows in any order), each divided by the planner's
    normaliser, sums to the unsplit loss and gradient; dropping the zero-advantage rows too."""
    batch = _policy_batch(seed=7)
    _, _, adv_B, mask_BT = batch
    whole, whole_grad = _loss_and_grad(*batch, [list(range(8))], name, mode, None)
    assert whole != 0 and (whole_grad != 0).any()
    normaliser = normaliser_of(mask_BT.sum(dim=1).long().tolist(), mode, 6.0)
    for pieces in ([[0, 1, 2], [3, 4, 5, 6, 7]], [[7], [2, 5], [0, 6, 1, 3, 4]]):
        split, split_grad = _loss_and_grad(*batch, pieces, name, mode, normaliser)
        torch.testing.assert_close(split, whole)
        torch.testing.assert_close(split_grad, whole_grad)
    kept = [[b for b in rows if adv_B[b] != 0] for rows in ([1, 2, 4], [5, 7])]
    pruned, pruned_grad = _loss_and_grad(*batch, kept, name, mode, normaliser)
    torch.testing.assert_close(pruned, whole)
    torch.testing.assert_close(pruned_grad, whole_grad)
    assert (whole_grad[adv_B == 0] == 0).all()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
@pytest.mark.parametrize("dp_size", [1, 3])
def test_planned_steps_equal_the_unsplit_mini_batches(name: str, mode: str, dp_size: int) -> None:
    """What the trainer runs: every micro-batch of every rank of a pruned plan, each with its
    loss weights as mask and the step's normaliser, sums to the unpruned mini-batch's loss."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _policy_batch(seed=8)
    response_tokens = mask_BT.sum(dim=1).long().tolist()
    plan = plan_step(
        PlannerInputs(
            seq_tokens=[n + 3 for n in response_tokens],
            response_tokens=response_tokens,
            advantages=adv_B.tolist(),
            group_ids=[b // 2 for b in range(8)],
            loss_agg=mode,
            loss_scale_factor=6.0,
            dp_size=dp_size,
            ppo_mini_batches=2,
            micro_batch_tokens=9,
            mode="match_loss_curve",
        )
    )
    assert plan.num_kept_sequences < 8 and plan.num_micro_batches > 2
    for step in plan.optimizer_steps:
        rows = list(range(4 * step.mini_batch, 4 * step.mini_batch + 4))
        # the mini-batch alone (its own default denominator); clip_cov / kl_cov's rule is the
        # whole step's, as the trainer fits it
        whole, _ = _loss_and_grad(logp_BT, old_logp_BT, adv_B, mask_BT, [rows], name, mode, None)
        leaf_BT = logp_BT.clone().requires_grad_(True)
        summed = leaf_BT.new_zeros(())
        for rank in step.ranks:
            for mb in rank.micro_batches:
                index = list(mb.seq_indices)
                weights_B1 = torch.tensor(mb.loss_weights, dtype=torch.float64)[:, None]
                summed = (
                    summed
                    + policy_loss(
                        leaf_BT[index],
                        old_logp_BT[index],
                        adv_B[index],
                        mask_BT[index] * weights_B1,
                        0.1,
                        0.15,
                        mode,
                        step.normaliser,
                        loss=name,
                        clip_ratio_c=1.5,
                        loss_scale_factor=6.0,
                        **loss_extras(name, old_logp_BT, adv_B, mask_BT, index),
                    ).loss
                )
        torch.testing.assert_close(summed.detach(), whole)


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

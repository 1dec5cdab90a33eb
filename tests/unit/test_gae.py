"""GAE advantages and returns, the clipped value loss and the critic metrics on hand-made numbers.

The references here are written from the formulas, not from the code under test:

* GAE, Schulman et al. (2015), "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", eq. 16: ``A_t = sum_l (gamma * lam)^l * delta_{t+l}`` with the TD error
  ``delta_t = r_t + gamma * V_{t+1} - V_t`` (eq. 10) and ``V = 0`` after the episode's end;
  computed below as that explicit double sum, where the code runs a backward recursion.
  The return (the critic's target) is ``A_t + V_t``; at ``gamma = lam = 1`` it is the
  Monte-Carlo return ``sum_{k >= t} r_k``.
* Value clipping as in OpenAI's PPO baselines (and verl's ``compute_value_loss``):
  ``0.5 * max((v - R)^2, (old + clip(v - old, -c, c) - R)^2)``.
* Whitening: ``(x - mean) / sqrt(var + 1e-8)`` over the valid tokens, Bessel-corrected variance
  (``statistics.variance``).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algo.gae import (
    critic_data_metrics,
    gae_advantage_return,
    masked_whiten,
    outcome_token_rewards,
    value_loss,
)
from megarl.algo.kl_reward import penalised_token_rewards


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _gae_by_definition(
    rewards: list[float], values: list[float], mask: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Raw (unwhitened) advantages and returns of one row by eq. 16's sum; 0 off the mask.

    Masked tokens are dropped first: the episode is the row's valid tokens in order.
    """
    steps = [t for t, m in enumerate(mask) if m]
    r = [rewards[t] for t in steps]
    v = [values[t] for t in steps] + [0.0]  # V after the last response token is 0
    deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(steps))]
    adv_row = [0.0] * len(mask)
    ret_row = [0.0] * len(mask)
    for k, t in enumerate(steps):
        a = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(steps) - k))
        adv_row[t] = a
        ret_row[t] = a + v[k]
    return adv_row, ret_row


def _whiten_by_hand(rows: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    valid = [
        x
        for row, m_row in zip(rows, mask, strict=True)
        for x, m in zip(row, m_row, strict=True)
        if m
    ]
    mean, var = statistics.fmean(valid), statistics.variance(valid)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(row, m_row, strict=True)]
        for row, m_row in zip(rows, mask, strict=True)
    ]


# ------------------------------------------------------------------------------------- GAE


def test_two_token_episode_worked_by_hand():
    """gamma = lam = 0.5, V = [1, 2], reward 4 on the last token:
    delta_1 = 4 + 0 - 2 = 2, delta_0 = 0 + 0.5 * 2 - 1 = 0;
    A_1 = 2, A_0 = 0 + 0.25 * 2 = 0.5; returns 4 and 1.5."""
    rewards = outcome_token_rewards(_t([4.0]), _t([[1.0, 1.0]]))
    assert rewards.tolist() == [[0.0, 4.0]]
    # a second, constant row only to give the whitening two samples of spread to look at
    result = gae_advantage_return(
        _t([[0.0, 4.0], [0.0, 0.0]]),
        _t([[1.0, 2.0], [0.0, 0.0]]),
        _t([[1.0, 1.0], [1.0, 1.0]]),
        gamma=0.5,
        lam=0.5,
    )
    assert result.returns_BT.tolist() == [[1.5, 4.0], [0.0, 0.0]]
    expected = _whiten_by_hand([[0.5, 2.0], [0.0, 0.0]], [[1, 1], [1, 1]])
    torch.testing.assert_close(result.advantages_BT, _t(expected))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95), (1.0, 0.0), (0.7, 0.3)])
def test_gae_matches_the_sum_of_discounted_td_errors(gamma: float, lam: float):
    """Right padding, a gap in the middle of a row, and an empty row, against eq. 16."""
    mask = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0]]
    values = [[0.3, -0.2, 0.5, 0.1], [0.7, 0.4, 9.0, 9.0], [-0.5, 9.0, 0.2, 0.6], [9.0] * 4]
    rewards = outcome_token_rewards(_t([1.0, 0.0, 2.0, 5.0]), _t(mask)).tolist()
    # a dense token reward too, so the test does not rely on the reward sitting at the end
    rewards[0][1] = -0.25

    result = gae_advantage_return(_t(rewards), _t(values), _t(mask), gamma=gamma, lam=lam)

    by_hand = [
        _gae_by_definition(r, v, m, gamma, lam)
        for r, v, m in zip(rewards, values, mask, strict=True)
    ]
    torch.testing.assert_close(result.returns_BT, _t([ret for _, ret in by_hand]))
    expected_adv = _whiten_by_hand([adv for adv, _ in by_hand], mask)
    torch.testing.assert_close(result.advantages_BT, _t(expected_adv))


def test_gamma_lam_one_gives_monte_carlo_returns():
    """With gamma = lam = 1 every token's return is the reward-to-go, whatever the critic says,
    and the raw advantage is that return minus the token's value."""
    mask = _t([[1, 1, 1], [1, 1, 0]])
    values = _t([[0.2, 0.9, -0.4], [0.5, 0.1, 0.0]])
    result = gae_advantage_return(outcome_token_rewards(_t([1.0, -1.0]), mask), values, mask)
    torch.testing.assert_close(result.returns_BT, _t([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    raw = [[1.0 - 0.2, 1.0 - 0.9, 1.0 + 0.4], [-1.0 - 0.5, -1.0 - 0.1, 0.0]]
    expected = _whiten_by_hand(raw, mask.tolist())
    torch.testing.assert_close(result.advantages_BT, _t(expected))


def test_kl_in_the_reward_enters_every_token():
    """Token rewards ``r_t = R * [t last] - beta * kl_t``; at gamma = lam = 1 the return is
    ``R - beta * sum_{k >= t} kl_k``."""
    mask = _t([[1, 1, 1]])
    kl = _t([[0.1, 0.4, 0.2]])
    token_rewards = penalised_token_rewards(_t([1.0]), kl, mask, beta=0.5)
    result = gae_advantage_return(token_rewards, torch.zeros(1, 3, dtype=torch.float64), mask)
    expected = [[1 - 0.5 * 0.7, 1 - 0.5 * 0.6, 1 - 0.5 * 0.2]]
    torch.testing.assert_close(result.returns_BT, _t(expected))


def test_gae_keeps_float32_and_rejects_mismatched_shapes():
    mask = torch.ones(2, 3)
    result = gae_advantage_return(torch.zeros(2, 3), torch.rand(2, 3), mask)
    assert result.advantages_BT.dtype == torch.float32
    assert result.returns_BT.dtype == torch.float32
    with pytest.raises(ValueError, match="same shape"):
        gae_advantage_return(torch.zeros(2, 3), torch.zeros(2, 4), mask)


def test_whitening_edge_cases():
    mask = _t([[1, 1, 0]])
    assert masked_whiten(_t([[3.0, 3.0, 7.0]]), mask).tolist() == [[0.0, 0.0, 0.0]]
    assert masked_whiten(_t([[3.0, 5.0, 7.0]]), _t([[0, 1, 0]])).tolist() == [[0.0, 0.0, 0.0]]
    assert masked_whiten(_t([[3.0, 5.0, 7.0]]), _t([[0, 0, 0]])).tolist() == [[0.0, 0.0, 0.0]]
    # token-weighted: the long row's tokens each count, so the mean is (1 + 1 + 4) / 3 = 2
    whitened = masked_whiten(_t([[1.0, 1.0], [4.0, 0.0]]), _t([[1, 1], [1, 0]]))
    sd = math.sqrt(statistics.variance([1.0, 1.0, 4.0]) + 1e-8)
    torch.testing.assert_close(whitened, _t([[-1 / sd, -1 / sd], [2 / sd, 0.0]]))


# ------------------------------------------------------------------------------ value loss

VPREDS = [[1.0, 0.0, 2.0]]
OLD_VALUES = [[0.5, 0.5, 0.5]]
RETURNS = [[2.0, -1.0, 0.0]]
# c = 0.2: clipped predictions 0.7, 0.3, 0.7.
# token 0: (1 - 2)^2 = 1    vs (0.7 - 2)^2 = 1.69 -> 1.69, clipped branch
# token 1: (0 + 1)^2 = 1    vs (0.3 + 1)^2 = 1.69 -> 1.69, clipped branch
# token 2: (2 - 0)^2 = 4    vs (0.7 - 0)^2 = 0.49 -> 4,    unclipped branch


def test_value_loss_worked_by_hand():
    vpreds = _t(VPREDS).requires_grad_()
    out = value_loss(vpreds, _t(OLD_VALUES), _t(RETURNS), torch.ones(1, 3), cliprange_value=0.2)
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 1.69 + 4.0) / 3)
    assert out.clipfrac.item() == pytest.approx(2 / 3)
    assert out.vpred_mean.item() == pytest.approx(1.0)
    out.loss.backward()
    # the clipped branch is flat in v (the clamp is active), so only token 2 gets a gradient:
    # d/dv 0.5 * (v - R)^2 / 3 = (2 - 0) / 3
    torch.testing.assert_close(vpreds.grad, _t([[0.0, 0.0, 2 / 3]]))


def test_value_loss_inside_the_clip_range_is_half_the_squared_error():
    out = value_loss(_t([[0.6, 0.4]]), _t([[0.5, 0.5]]), _t([[1.0, 0.0]]), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(0.5 * (0.4**2 + 0.4**2) / 2)
    assert out.clipfrac.item() == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_value_loss_pieces_with_the_whole_denominator_add_up(agg: str):
    """The aggregation is the actor's: split rows, share the unsplit normaliser, sum."""
    vpreds = _t([[1.0, 0.0, 2.0], [0.3, -0.6, 0.0]])
    old = _t([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    returns = _t([[2.0, -1.0, 0.0], [1.0, 1.0, 0.0]])
    mask = _t([[1, 1, 1], [1, 1, 0]])
    whole = value_loss(vpreds, old, returns, mask, agg=agg)
    denom = mask.sum() if agg == "token-mean" else 2.0
    pieces = [
        value_loss(
            vpreds[i : i + 1], old[i : i + 1], returns[i : i + 1], mask[i : i + 1], 0.5, agg, denom
        )
        for i in range(2)
    ]
    torch.testing.assert_close(sum(p.loss for p in pieces), whole.loss)


def test_padding_does_not_enter_the_value_loss():
    mask = _t([[1, 0]])
    out = value_loss(_t([[0.6, 100.0]]), _t([[0.5, 0.0]]), _t([[1.0, -50.0]]), mask)
    assert out.loss.item() == pytest.approx(0.5 * 0.4**2)
    assert out.vpred_mean.item() == pytest.approx(0.6)


# --------------------------------------------------------------------------------- metrics


def test_critic_data_metrics_by_hand():
    """values [1, 2, 3], returns [1, 2, 4] on the valid tokens (a padded 9 is ignored):
    var(returns - values) = var([0, 0, 1]) = 1/3, var(returns) = 7/3."""
    values = _t([[1.0, 2.0], [3.0, 9.0]])
    returns = _t([[1.0, 2.0], [4.0, 9.0]])
    metrics = critic_data_metrics(values, returns, _t([[1, 1], [1, 0]]))
    assert metrics["critic/vf_explained_var"] == pytest.approx(1 - (1 / 3) / (7 / 3 + 1e-5))
    assert metrics["critic/values/mean"] == pytest.approx(2.0)
    assert metrics["critic/values/max"] == 3.0
    assert metrics["critic/values/min"] == 1.0
    assert metrics["critic/returns/mean"] == pytest.approx(7 / 3)
    assert metrics["critic/returns/max"] == 4.0
    assert metrics["critic/returns/min"] == 1.0


def test_explained_variance_of_a_perfect_and_of_a_constant_critic():
    returns = _t([[1.0, 2.0, 4.0]])
    mask = torch.ones(1, 3)
    perfect = critic_data_metrics(returns, returns, mask)["critic/vf_explained_var"]
    assert perfect == pytest.approx(1.0)
    constant = critic_data_metrics(torch.full((1, 3), 5.0), returns, mask)
    assert constant["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-4)
    assert critic_data_metrics(returns, returns, torch.zeros(1, 3)) == {}

"""ECHO's term on observation tokens (``actor.echo_coef``): the value against a direct
transcription, exact under splits with the shared normaliser, the advantage playing no part,
its statistics reported only when it is on, and the config key."""

from __future__ import annotations

import pytest
import torch

from megarl.actor.train_stats import OptimizerStepStats, summarise_update
from megarl.algo.losses import echo_loss


def _random(seed: int, rows: int = 6, width: int = 9):
    gen = torch.Generator().manual_seed(seed)
    logp_BT = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3
    observation_BT = (torch.rand(rows, width, generator=gen) < 0.4).double()
    return logp_BT, observation_BT


@pytest.mark.parametrize("seed", [0, 1])
def test_echo_loss_is_the_observation_tokens_nll_over_the_normaliser(seed: int) -> None:
    logp_BT, observation_BT = _random(seed)
    denom = 17.0
    expected = (
        sum(
            -logp_BT[b, t].item()
            for b in range(logp_BT.shape[0])
            for t in range(logp_BT.shape[1])
            if observation_BT[b, t] > 0
        )
        / denom
    )
    assert echo_loss(logp_BT, observation_BT, "token-mean", denom).item() == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_echo_loss_split_into_micro_batches_sums_to_the_whole(agg: str) -> None:
    """Each piece divided by the whole mini-batch's normaliser: the pieces add up exactly."""
    logp_BT, observation_BT = _random(3)
    denom = 23.0
    whole = echo_loss(logp_BT, observation_BT, agg, denom)
    pieces = sum(
        echo_loss(logp_BT[rows], observation_BT[rows], agg, denom)
        for rows in ([0, 1], [2], [3, 4, 5])
    )
    torch.testing.assert_close(pieces, whole, rtol=1e-12, atol=0)


def test_echo_gradient_reaches_only_observation_tokens() -> None:
    logp_BT, observation_BT = _random(4)
    logp_BT.requires_grad_(True)
    echo_loss(logp_BT, observation_BT, "token-mean", 10.0).backward()
    assert logp_BT.grad is not None
    assert torch.equal(logp_BT.grad == 0, observation_BT == 0)
    torch.testing.assert_close(
        logp_BT.grad[observation_BT > 0], torch.full_like(logp_BT.grad[observation_BT > 0], -0.1)
    )


def test_echo_statistics_are_reported_only_when_echo_is_on() -> None:
    steps = [OptimizerStepStats(pg_loss=0.5, echo_loss=2.0, echo_tokens=30.0, num_tokens=5.0)] * 2
    on = summarise_update(steps, [1.0, 1.0], echo=True).metrics()
    assert on["actor/echo_loss"] == 2.0 and on["actor/echo_tokens"] == 30.0
    off = summarise_update([OptimizerStepStats(pg_loss=0.5, num_tokens=5.0)] * 2, [1.0, 1.0])
    assert not any(key.startswith("actor/echo") for key in off.metrics())


def test_echo_coef_config() -> None:
    from megarl.config.schema import ConfigError, build_run_config

    assert build_run_config({}).actor.echo_coef == 0.0
    assert build_run_config({"actor": {"echo_coef": 0.1}}).actor.echo_coef == 0.1
    with pytest.raises(ConfigError, match=r"actor.echo_coef=-0.1: must be >= 0 \(0 = off\)"):
        build_run_config({"actor": {"echo_coef": -0.1}})


def test_echo_turns_auto_pruning_off_for_the_run() -> None:
    from megarl.config.planning import prune_mode
    from megarl.config.schema import build_run_config

    mode, reason = prune_mode(build_run_config({"actor": {"echo_coef": 0.1}}))
    assert mode == "off" and "actor.echo_coef=0.1" in reason
    assert prune_mode(build_run_config({}))[0] == "match_loss_curve"

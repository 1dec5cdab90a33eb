"""Rollout correction in a real tiny run (Megatron on CPU, the hf engine), with a known mismatch.

In fp32 the engine and the trainer agree to ~1e-5, so the correction is about the identity; the
test injects a mismatch by shifting the engine's log-probs (+0.3 nats on even response
positions, -1.0 on odd ones: ratios pi_old / pi_rollout of e^-0.3 and e) after sampling, so the
tokens, rewards and advantages stay those of the unshifted run. Two mini-batches make the first
optimizer step take its old log-probs from the training forward and the second from the
recompute pass: both must be the trainer's own.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megarl.trainer.rollout_host import RolloutHost

COMMON = {"actor.ppo_mini_batches": 2, "rollout.max_logprob_diff": "null"}
"""The shifted logprobs would stop the run at the logprob guard: off, as the point is to train."""
CORRECTION = {
    "algo.rollout_correction.rollout_is": "token",
    "algo.rollout_correction.rollout_rs": "token",  # bounds [0.5, 2]: every odd token goes
    "algo.rollout_correction.rollout_token_veto_threshold": 1e-4,  # no ratio is that small
}
VETO_EVERY_RESPONSE = {"algo.rollout_correction.rollout_token_veto_threshold": 0.8}
"""Every response has an even position (ratio e^-0.3 < 0.8), so the veto drops every one."""


def _shift(logprobs: torch.Tensor) -> torch.Tensor:
    odd = torch.arange(logprobs.numel()) % 2 == 1
    return logprobs + torch.where(odd, -1.0, 0.3).to(logprobs.dtype)


@pytest.fixture
def shifted_engine(monkeypatch):
    produce = RolloutHost.rollout

    def rollout(self, step):
        batch, metrics, phases = produce(self, step)
        shifted = tuple(_shift(lp) for lp in batch.engine_logprobs)
        return dataclasses.replace(batch, engine_logprobs=shifted), metrics, phases

    monkeypatch.setattr(RolloutHost, "rollout", rollout)


def _odd_fraction(step: dict) -> float:
    """Fraction of compared tokens at odd response positions: those with ratio e > 2, which
    the run reports as the fraction above ``rollout_is_threshold``."""
    return step["rollout_corr/rollout_is_ratio_fraction_high"]


def test_shifted_engine_is_measured_and_corrected(tiny_run, shifted_engine, tmp_path) -> None:
    """One step with the correction off, one with it on: the same rollout and the same measured
    mismatch; only the corrected run rejects the odd tokens and so reports another loss. A
    third run whose veto catches every response trains on nothing: its policy loss is 0. (The
    unshifted run's ``rollout_corr/*`` ~ identity is checked in test_train_e2e.py.)"""
    [off] = tiny_run(steps=1, **COMMON).history
    (tmp_path / "run").rename(tmp_path / "off")
    [on] = tiny_run(steps=1, **COMMON, **CORRECTION).history
    lo, hi = math.exp(-0.3), math.e
    for m in (off, on):
        odd = _odd_fraction(m)
        assert 0.3 < odd < 0.6
        assert m["rollout_corr/rollout_is_max"] == pytest.approx(hi, rel=1e-3)
        assert m["rollout_corr/rollout_is_min"] == pytest.approx(lo, rel=1e-3)
        # KL(pi_rollout || pi_old) estimate = mean(log pi_rollout - log pi_old) = mean shift
        assert m["rollout_corr/kl"] == pytest.approx(0.3 * (1 - odd) - 1.0 * odd, abs=1e-3)
        expected_mean = hi * odd + lo * (1 - odd)
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(expected_mean, rel=1e-3)
        assert m["gates/summary"].startswith("old_lp: 4/8 recompute, rest train forward (")
        # ESS of the token weights clamped to [1/2, 2]: e^-0.3 on even positions, 2 on odd
        # ones (verl's 1 / mean((w / mean w)^2) = mean(w)^2 / mean(w^2))
        mean_w = 2.0 * odd + lo * (1 - odd)
        mean_w2 = 4.0 * odd + lo**2 * (1 - odd)
        ess = m["rollout_corr/rollout_is_eff_sample_size"]
        assert ess == pytest.approx(mean_w**2 / mean_w2, rel=1e-3)
        assert m["rollout_corr/rollout_is_veto_fraction"] == 0.0  # no ratio below 1e-4
        assert m["rollout_corr/rollout_is_catastrophic_token_fraction"] == 0.0
    assert off["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert on["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(_odd_fraction(on))
    assert off["critic/rewards/mean"] == on["critic/rewards/mean"]
    assert off["actor/pg_loss"] != pytest.approx(on["actor/pg_loss"], abs=1e-6)

    (tmp_path / "run").rename(tmp_path / "on")
    [vetoed] = tiny_run(steps=1, **COMMON, **VETO_EVERY_RESPONSE).history
    odd = _odd_fraction(vetoed)
    assert odd == pytest.approx(_odd_fraction(off))  # the same rollout
    assert vetoed["rollout_corr/rollout_is_veto_fraction"] == 1.0
    assert vetoed["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 - odd)
    assert vetoed["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # the veto is not rejection
    assert vetoed["actor/pg_loss"] == 0.0  # every token at weight 0, in both optimizer steps

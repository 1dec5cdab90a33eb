"""Divergence on plain numbers: which updates stop the run, which are skipped and counted, and
the engine's sampler refusing non-finite logits by name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megarl.actor.train_stats import OptimizerStepStats, summarise_update
from megarl.algo.divergence import DivergenceError
from megarl.config.schema import build_run_config
from megarl.engines.base import NonFiniteLogitsError, SamplingParams
from megarl.engines.sampling import sample_next_tokens
from megarl.trainer.actor_update import check_update


def _result(grad_norm: float, weights_finite: bool = True):
    return SimpleNamespace(grad_norm=grad_norm, weights_finite=weights_finite)


def test_a_nonfinite_grad_norm_stops_the_run_naming_the_step_and_the_settings():
    cfg = build_run_config({"actor": {"lr": 10.0}})
    check_update(cfg, 3, 0, _result(1.5))  # finite: nothing to say
    with pytest.raises(DivergenceError) as stopped:
        check_update(cfg, 3, 1, _result(math.nan))
    assert str(stopped.value) == (
        "training diverged at step 3: actor/grad_norm is nan at optimizer step 2 of the step, "
        "so its update was not applied; lower actor.lr=10 or lower actor.optim.grad_clip=1, or "
        "set trainer.skip_nonfinite_updates=true to skip such updates and train on"
    )
    assert stopped.value.exit_code == 1


def test_skipping_is_asked_for_by_name_and_weights_that_diverged_always_stop():
    cfg = build_run_config({"trainer": {"skip_nonfinite_updates": True}})
    check_update(cfg, 2, 0, _result(math.inf))  # skipped: the caller counts it
    with pytest.raises(DivergenceError, match="the weights after optimizer step 1 of the step"):
        check_update(cfg, 2, 0, _result(1.0, weights_finite=False))


def test_a_skipped_update_is_counted_and_left_out_of_the_statistics():
    applied = OptimizerStepStats(pg_loss=0.5, num_tokens=4.0, response_tokens=4.0)
    skipped = OptimizerStepStats(pg_loss=math.nan, num_tokens=4.0, response_tokens=4.0)
    stats = summarise_update([applied, skipped], [2.0, math.nan])
    assert stats.skipped_nonfinite_updates == 1 and stats.num_optimizer_steps == 2
    assert stats.pg_loss == 0.5 and stats.grad_norm == 2.0
    assert stats.metrics()["actor/skipped_nonfinite_updates"] == 1.0
    assert summarise_update([applied], [2.0]).metrics()["actor/skipped_nonfinite_updates"] == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_the_sampler_refuses_nonfinite_logits_by_name(bad):
    logits = torch.zeros(3, 5)
    logits[1, 2] = bad
    params = SamplingParams(temperature=1.0, max_new_tokens=1)
    with pytest.raises(NonFiniteLogitsError, match="not finite in 1 rows"):
        sample_next_tokens(logits, params, torch.full((3,), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_weights_check_agrees_with_isfinite_element_by_element(dtype):
    from megarl.actor.optim import all_finite

    def weights():
        return [
            torch.randn(64, 32).to(dtype),
            torch.randn(7).to(dtype),
            torch.zeros(3, dtype=dtype),
        ]

    assert bool(all_finite(weights()))
    assert bool(all_finite([]))
    for bad in (math.nan, math.inf, -math.inf):
        tensors = weights()
        tensors[1][5] = bad
        assert not bool(all_finite(tensors)), bad
    if dtype is not torch.float16:  # an fp16 sum, taken in fp32, cannot overflow
        # finite weights whose sum overflows (each at the dtype's largest value) are finite
        big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)
        assert bool(torch.isfinite(big).all()) and not bool(big.float().sum().isfinite())
        assert bool(all_finite([big, *weights()]))
        big[2] = math.nan
        assert not bool(all_finite([big]))

"""Divergence in a real run (tiny model, one rank): a NaN gradient or a learning rate that
blows the weights up stops the run with one line naming the step and the cause, before the
engine or a checkpoint sees a non-finite weight; or, asked for, the update is skipped and
counted and training goes on."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.runs import tiny_overrides

from megarl.actor.megatron_actor import MegatronActor
from megarl.algo.divergence import DivergenceError
from megarl.train import run

pytestmark = pytest.mark.slow


def _nan_gradient_at(monkeypatch, call: int) -> None:
    """Every rank's gradient of one weight becomes NaN in the ``call``-th optimizer step (the
    run has one rank, in this process, one optimizer step per training step)."""
    original = MegatronActor._finalize_grads
    calls = {"n": 0}

    def poisoned(self) -> None:
        original(self)
        calls["n"] += 1
        if calls["n"] == call:
            first = next(p for p in self.model.parameters() if p.requires_grad)
            first.main_grad.view(-1)[0] = math.nan

    monkeypatch.setattr(MegatronActor, "_finalize_grads", poisoned)


def test_a_nan_gradient_stops_the_run_at_its_step_and_nothing_is_saved(tmp_path, monkeypatch):
    _nan_gradient_at(monkeypatch, 2)
    run_dir = tmp_path / "run"
    with pytest.raises(DivergenceError) as stopped:
        run(tiny_overrides(run_dir, 3, **{"trainer.save_interval": 1}))
    assert str(stopped.value).startswith(
        "training diverged at step 2: actor/grad_norm is nan at optimizer step 1 of the step"
    )
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_000001"]  # step 1's, complete; nothing of step 2


def test_a_skipped_nan_update_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    _nan_gradient_at(monkeypatch, 2)
    settings = {"trainer.skip_nonfinite_updates": "true", "planner.prune_zero_adv": "off"}
    result = run(tiny_overrides(tmp_path / "run", 3, **settings), return_final_state=True)
    skipped = [row["actor/skipped_nonfinite_updates"] for row in result.history]
    assert skipped == [0.0, 1.0, 0.0]
    last = result.history[-1]
    assert math.isfinite(last["actor/grad_norm"]) and last["actor/grad_norm"] > 0
    assert last["rollout/logprob_abs_diff"] <= 1e-4  # the engine serves the unchanged weights
    assert all(torch.isfinite(t).all() for t in result.final_state.values())


@pytest.mark.parametrize(
    ("lr", "message"),
    [
        (1e4, "training diverged at step 2: actor/grad_norm is nan"),
        (
            1e12,
            (
                "training diverged before step 2: the engine's sampling probabilities are not "
                "finite under the weights of policy version 1"
            ),
        ),
    ],
)
def test_a_learning_rate_that_diverges_is_named(tmp_path, lr, message):
    with pytest.raises(DivergenceError) as stopped:
        run(tiny_overrides(tmp_path / "run", 3, **{"actor.lr": lr}))
    assert str(stopped.value).startswith(message) and "actor.lr" in str(stopped.value)


def test_weights_an_update_left_nonfinite_never_reach_the_engine(tmp_path, monkeypatch):
    """An update that writes inf into a weight with a finite gradient norm (what Megatron's GPU
    optimizer would do with a NaN it applies before megarl sees the norm): the check after the
    step stops the run, even with skipping on, before the weights are sent or saved."""
    from megarl.actor.optim import MegatronOptimizer

    original = MegatronOptimizer.step
    calls = {"n": 0}

    def poisoning(self) -> float:
        norm = original(self)
        calls["n"] += 1
        if calls["n"] == 2:
            with torch.no_grad():
                next(self.chunks[0].parameters()).view(-1)[0] = math.inf
        return norm

    monkeypatch.setattr(MegatronOptimizer, "step", poisoning)
    run_dir = tmp_path / "run"
    settings = {"trainer.save_interval": 1, "trainer.skip_nonfinite_updates": "true"}
    with pytest.raises(DivergenceError) as stopped:
        run(tiny_overrides(run_dir, 3, **settings))
    assert str(stopped.value).startswith(
        "training diverged at step 2: the weights after optimizer step 1 of the step are not finite"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]

"""Every recipe of ``configs/recipe/`` without a test of its own (PPO and DAPO have theirs) trains
2 steps end to end on the tiny model at DP=2, as a verl user would start it: ``recipe=<name>``."""

from __future__ import annotations

import math

import pytest
from helpers.runs import tiny_overrides

from megarl.train import run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("recipe", "own_metric"),
    [
        ("grpo", "actor/kl_loss"),  # its KL loss to the reference model
        ("dr_grpo", None),
        ("gspo", "actor/pg_clipfrac"),  # its sequence-level clip
        ("rloo", None),
    ],
)
def test_the_recipe_trains_two_steps_at_dp2(tmp_path, recipe, own_metric):
    overrides = {"recipe": recipe, "trainer.n_gpus_per_node": 2}
    history = run(tiny_overrides(tmp_path / recipe, steps=2, **overrides)).history
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row  # the engine got step 1's weights
        if own_metric is not None:
            assert math.isfinite(row[own_metric]), (own_metric, row)
    assert any(row["actor/grad_norm"] > 0 for row in history)  # something was trained


@pytest.mark.parametrize(
    "recipe",
    ["dppo_tv", "dppo_kl", "prime_dppo", "gmpo", "sapo", "gpg", "clip_cov", "kl_cov", "m2po"],
)
def test_the_policy_loss_recipes_train_two_steps_at_dp2(tmp_path, recipe):
    """The 2026 losses end to end: 2 optimizer steps per batch (so the ratio moves and the
    trust regions can act), the tokens of clip_cov / kl_cov selected once per step over the
    batch and split over 2 DP ranks."""
    overrides = {
        "recipe": recipe,
        "trainer.n_gpus_per_node": 2,
        "actor.ppo_mini_batches": 1 if recipe == "gpg" else 2,
    }
    history = run(tiny_overrides(tmp_path / recipe, steps=2, **overrides)).history
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert math.isfinite(row["actor/pg_clipfrac"]), row
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row  # the engine got step 1's weights
    assert any(row["actor/grad_norm"] > 0 for row in history)  # something was trained

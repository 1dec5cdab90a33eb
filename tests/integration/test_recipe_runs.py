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


TWO_REWARDS = (
    "[{name: parity, fn: 'synthetic_rewards:char_parity'},"
    " {name: mixed, fn: 'synthetic_rewards:mixed_groups', weight: 0.5}]"
)


@pytest.mark.parametrize(
    ("overrides", "own_metrics"),
    [
        ({"recipe": "maxrl"}, ()),
        (
            {"recipe": "gdpo", "data.reward": TWO_REWARDS},
            ("reward/parity/mean", "reward/mixed/mean"),
        ),
        ({"algo.length_penalty.type": "linear"}, ("critic/rewards/length_penalty",)),
        (
            {
                "rollout.agent.loop": "agent_loops:TwoTurns",
                "rollout.max_new_tokens": 40,
                "actor.echo_coef": 0.1,
            },
            ("actor/echo_loss",),
        ),
    ],
    ids=["maxrl", "gdpo_two_rewards", "length_penalty", "echo"],
)
def test_the_2026_estimators_and_shaping_train_two_steps(tmp_path, overrides, own_metrics):
    """MaxRL, GDPO over two reward functions, the length penalty and ECHO (on the two-turn
    agent loop, whose trajectories carry an 8-token observation each): 2 steps each."""
    history = run(tiny_overrides(tmp_path / "run", steps=2, **overrides)).history
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row
        for metric in own_metrics:
            assert math.isfinite(row[metric]), (metric, row)
    if "actor.echo_coef" in overrides:
        for row in history:  # 8 trajectories x 8 observation tokens, one optimizer step
            assert row["actor/echo_tokens"] == 64.0 and row["actor/echo_loss"] > 0, row
            assert "actor.echo_coef=0.1" in row["planner/summary"], row
    assert any(row["actor/grad_norm"] > 0 for row in history)


@pytest.mark.parametrize(
    "recipe",
    # The losses with wiring of their own (a token rule fitted over the batch and broadcast, a
    # loss term that turns pruning off); the others are one function each, tested against
    # their papers' formulas in tests/unit/test_policy_losses.py.
    ["prime_dppo", "clip_cov", "kl_cov", "m2po"],
)
def test_the_policy_loss_recipes_train_two_steps_at_dp2(tmp_path, recipe):
    """The 2026 losses with wiring of their own, end to end: 2 optimizer steps per batch (so the ratio moves and the
    trust regions can act), the tokens of clip_cov / kl_cov selected once per step over the
    batch and split over 2 DP ranks."""
    overrides = {
        "recipe": recipe,
        "trainer.n_gpus_per_node": 2,
        "actor.ppo_mini_batches": 2,
    }
    history = run(tiny_overrides(tmp_path / recipe, steps=2, **overrides)).history
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert math.isfinite(row["actor/pg_clipfrac"]), row
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row  # the engine got step 1's weights
    assert any(row["actor/grad_norm"] > 0 for row in history)  # something was trained

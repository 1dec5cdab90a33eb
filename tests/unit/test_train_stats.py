"""The actor update's metrics: each the mean over optimizer steps (verl's convention)."""

import pytest

from megarl.actor.train_stats import OptimizerStepStats, sum_micro_batches, summarise_update
from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import PlannerInputs


def _four_steps() -> list[OptimizerStepStats]:
    """``ppo_mini_batches=2, ppo_epochs=2``: four optimizer steps, already summed over ranks."""
    return [
        OptimizerStepStats(
            pg_loss=0.4,
            kl_loss=0.02,
            entropy_sum=20.0,
            response_tokens=10.0,
            clipfrac_sum=1.0,
            ppo_kl_sum=0.1,
            num_tokens=10.0,
        ),
        OptimizerStepStats(
            pg_loss=-0.2,
            kl_loss=0.04,
            entropy_sum=30.0,
            response_tokens=30.0,
            clipfrac_sum=3.0,
            ppo_kl_sum=0.9,
            num_tokens=30.0,
            clipfrac_lower_sum=6.0,
        ),
        OptimizerStepStats(
            pg_loss=0.1,
            kl_loss=0.06,
            entropy_sum=10.0,
            response_tokens=10.0,
            clipfrac_sum=5.0,
            ppo_kl_sum=0.5,
            num_tokens=10.0,
        ),
        OptimizerStepStats(
            pg_loss=0.5,
            kl_loss=0.08,
            entropy_sum=60.0,
            response_tokens=30.0,
            clipfrac_sum=0.0,
            ppo_kl_sum=0.3,
            num_tokens=30.0,
        ),
    ]


def test_two_mini_batches_two_epochs_report_the_mean_over_the_four_optimizer_steps() -> None:
    plan = plan_step(
        PlannerInputs(
            seq_tokens=(8,) * 8,
            response_tokens=(4,) * 8,
            advantages=(1.0, -1.0) * 4,
            group_ids=(0, 0, 1, 1, 2, 2, 3, 3),
            ppo_mini_batches=2,
            ppo_epochs=2,
        )
    )
    assert len(plan.optimizer_steps) == 4
    got = summarise_update(_four_steps(), grad_norms=[1.0, 2.0, 3.0, 6.0])
    assert got.num_optimizer_steps == 4
    assert got.pg_loss == pytest.approx((0.4 - 0.2 + 0.1 + 0.5) / 4)  # not their sum, 0.8
    assert got.kl_loss == pytest.approx(0.05)
    assert got.grad_norm == pytest.approx(3.0)
    assert got.entropy == pytest.approx((2.0 + 1.0 + 1.0 + 2.0) / 4)
    assert got.pg_clipfrac == pytest.approx((0.1 + 0.1 + 0.5 + 0.0) / 4)
    assert got.ppo_kl == pytest.approx((0.01 + 0.03 + 0.05 + 0.01) / 4)
    assert got.pg_clipfrac_lower == pytest.approx((0.0 + 0.2 + 0.0 + 0.0) / 4)
    metrics = got.metrics()
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.05)
    assert metrics["actor/pg_loss"] == pytest.approx(0.2)
    assert metrics["actor/num_optimizer_steps"] == 4


def test_one_optimizer_step_is_its_own_value() -> None:
    step = _four_steps()[1]
    got = summarise_update([step], grad_norms=[2.5], lp_diff_sum=3.0, lp_diff_count=4.0)
    assert (got.pg_loss, got.entropy, got.pg_clipfrac, got.grad_norm) == (-0.2, 1.0, 0.1, 2.5)
    assert got.logprob_abs_diff == pytest.approx(0.75)


def test_a_ghost_step_counts_in_the_losses_but_has_no_token_ratio() -> None:
    trained = _four_steps()[0]
    got = summarise_update([trained, OptimizerStepStats()], grad_norms=[1.0, 0.5])
    assert got.pg_loss == pytest.approx(0.2)
    assert got.grad_norm == pytest.approx(0.75)
    assert got.entropy == pytest.approx(2.0)
    assert got.pg_clipfrac == pytest.approx(0.1)
    assert got.logprob_abs_diff == 0.0


def test_rows_round_trip_and_add() -> None:
    a, b = _four_steps()[:2]
    assert OptimizerStepStats.from_row(a.to_row()) == a
    assert (a + b).num_tokens == 40.0
    with pytest.raises(ValueError, match="expected 8 statistics"):
        OptimizerStepStats.from_row([1.0])
    with pytest.raises(ValueError, match="grad norms"):
        summarise_update([a], grad_norms=[])


def test_a_ranks_step_statistics_are_its_micro_batches_summed_field_by_field():
    import torch

    entries = [
        {"pg_loss": torch.tensor(0.25), "num_tokens": torch.tensor(3.0), "clipfrac_sum": 1.0},
        {"pg_loss": 0.5, "num_tokens": 5.0, "entropy_sum": torch.tensor(2.5)},
    ]
    total = sum_micro_batches(OptimizerStepStats, entries)
    assert total == OptimizerStepStats(
        pg_loss=0.75, num_tokens=8.0, clipfrac_sum=1.0, entropy_sum=2.5
    )
    assert sum_micro_batches(OptimizerStepStats, []) == OptimizerStepStats()  # off the last stage


def test_the_critics_metrics_are_means_over_steps_with_ghost_steps_out_of_the_ratios():
    from megarl.critic.value_stats import CriticStepStats, summarise_critic_update

    steps = [
        CriticStepStats(vf_loss=0.4, vf_clipfrac_sum=2.0, vpred_sum=5.0, num_tokens=10.0),
        CriticStepStats(),  # a ghost step: no tokens, zero loss
        CriticStepStats(vf_loss=0.2, vf_clipfrac_sum=1.0, vpred_sum=-5.0, num_tokens=20.0),
    ]
    metrics = summarise_critic_update(steps, [1.0, 2.0, 6.0])
    assert metrics == pytest.approx(
        {
            "critic/vf_loss": 0.2,
            "critic/vf_clipfrac": (0.2 + 0.05) / 2,
            "critic/vpred_mean": (0.5 - 0.25) / 2,
            "critic/grad_norm": 3.0,
        }
    )

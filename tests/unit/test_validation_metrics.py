"""Validation scores in verl's names, by hand on plain lists."""

from __future__ import annotations

import pytest

from megarl.algo.validation import (
    is_validation_step,
    pass_at_k,
    subset_sizes,
    validation_metrics,
)


def test_scores_per_data_source_by_hand():
    metrics = validation_metrics(
        ["openai/gsm8k", "openai/gsm8k", "math"],
        [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]],
        [4, 6, 8, 10, 2, 6],
    )
    exact = {
        "val-core/openai/gsm8k/reward/mean@2": 0.25,
        "val-aux/openai/gsm8k/reward/std@2": 0.25,  # (0.5 + 0) / 2
        "val-aux/openai/gsm8k/pass@2": 0.5,  # one of two prompts has a right sample
        "val-core/math/reward/mean@2": 0.75,
        "val-aux/math/reward/std@2": 0.25,
        "val-aux/math/pass@2": 1.0,
        "val-aux/response_length/mean": 6.0,
    }
    assert {key: metrics[key] for key in exact} == pytest.approx(exact)
    # bootstrap (2 of 2 samples, with replacement): E[best] of {1, 0} = 1 - 1/4, of {0, 0} = 0
    assert metrics["val-aux/openai/gsm8k/reward/best@2/mean"] == pytest.approx(0.375, abs=0.03)
    assert metrics["val-aux/openai/gsm8k/reward/worst@2/mean"] == pytest.approx(0.125, abs=0.03)
    assert "val-aux/math/reward/maj@2/mean" not in metrics  # no answers given: no vote


def test_bootstrapped_best_worst_and_maj_follow_their_expectations():
    """With c right of n samples drawn k at a time with replacement (p = c / n):
    E[best@k] = 1 - (1 - p)^k, E[worst@k] = p^k, and for maj@k with every wrong sample giving
    its own answer and every right one the same, the majority is right once two draws are
    right or all draws agree. Checked against 1000 draws per prompt, within 3 sigma."""
    rewards = [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 50  # p = 1/4, n = 8
    answers = [["42", "42", "a", "b", "c", "d", "e", "f"]] * 50
    metrics = validation_metrics(["s"] * 50, rewards, [1] * 400, answers)
    p = 0.25
    for k in (2, 4, 8):
        tol = 3 * (0.5 / (1000 * 50) ** 0.5)
        best = metrics[f"val-aux/s/reward/best@{k}/mean"]
        worst = metrics[f"val-aux/s/reward/worst@{k}/mean"]
        assert best == pytest.approx(1 - (1 - p) ** k, abs=tol)
        assert worst == pytest.approx(p**k, abs=tol)
        assert metrics[f"val-aux/s/reward/best@{k}/std"] == pytest.approx(
            ((1 - (1 - p) ** k) * (1 - p) ** k) ** 0.5, abs=0.01
        )
    # maj@2: two right (p^2), or one right drawn first of a tie (2 p (1 - p) / 2)
    assert metrics["val-aux/s/reward/maj@2/mean"] == pytest.approx(p * p + p * (1 - p), abs=0.01)
    assert set(metrics) >= {"val-aux/s/pass@2", "val-aux/s/pass@4", "val-aux/s/pass@8"}


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [(8, 2, 1, 0.25), (8, 2, 2, 1 - 15 / 28), (8, 2, 7, 1.0), (4, 0, 2, 0.0), (4, 4, 4, 1.0)],
)
def test_pass_at_k_is_the_unbiased_estimator(n, correct, k, expected):
    """Chen et al. (2021), eq. 1: 1 - C(n-c, k) / C(n, k); e.g. C(6,2)/C(8,2) = 15/28."""
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


def test_subset_sizes_are_powers_of_two_then_n():
    assert [subset_sizes(n) for n in (1, 2, 3, 8, 10)] == [
        [],
        [2],
        [2, 3],
        [2, 4, 8],
        [2, 4, 8, 10],
    ]


def test_validation_does_not_touch_the_global_random_streams():
    import random

    import numpy as np

    random.seed(7)
    np.random.seed(7)
    expected = (random.random(), np.random.rand())
    random.seed(7)
    np.random.seed(7)
    validation_metrics(["s"], [[1.0, 0.0, 1.0, 0.0]], [1, 2, 3, 4], [["1", "2", "1", "3"]])
    assert (random.random(), np.random.rand()) == expected


def test_one_sample_reports_the_mean_only_and_an_unnamed_source_is_unknown():
    metrics = validation_metrics(["", ""], [[1.0], [0.0]], [3, 5])
    assert metrics == {"val-core/unknown/reward/mean@1": 0.5, "val-aux/response_length/mean": 4.0}


def test_uneven_samples_are_refused():
    with pytest.raises(ValueError, match="same number"):
        validation_metrics(["a", "a"], [[1.0], [1.0, 0.0]], [1, 1, 1])


@pytest.mark.parametrize(
    ("step", "total", "interval", "expected"),
    [(2, 5, 2, True), (3, 5, 2, False), (5, 5, 2, True), (5, 5, 0, False), (1, 1, 3, True)],
)
def test_validation_steps_are_every_interval_and_the_last(step, total, interval, expected):
    assert is_validation_step(step, total, interval) is expected


def test_validation_before_training_runs_on_a_fresh_start_only():
    from megarl.algo.validation import validates_before_training

    assert validates_before_training(True, 0)
    assert not validates_before_training(True, 3)  # a resume: step 3 has its record already
    assert not validates_before_training(False, 0)

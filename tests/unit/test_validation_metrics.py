"""Validation scores in verl's names, by hand on plain lists."""

from __future__ import annotations

import pytest

from megarl.algo.validation import is_validation_step, validation_metrics


def test_scores_per_data_source_by_hand():
    metrics = validation_metrics(
        ["openai/gsm8k", "openai/gsm8k", "math"],
        [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]],
        [4, 6, 8, 10, 2, 6],
    )
    assert metrics == pytest.approx(
        {
            "val-core/openai/gsm8k/reward/mean@2": 0.25,
            "val-aux/openai/gsm8k/reward/std@2": 0.25,  # (0.5 + 0) / 2
            "val-aux/openai/gsm8k/reward/best@2/mean": 0.5,
            "val-aux/openai/gsm8k/reward/worst@2/mean": 0.0,
            "val-aux/openai/gsm8k/pass@2": 0.5,
            "val-core/math/reward/mean@2": 0.75,
            "val-aux/math/reward/std@2": 0.25,
            "val-aux/math/reward/best@2/mean": 1.0,
            "val-aux/math/reward/worst@2/mean": 0.5,
            "val-aux/math/pass@2": 1.0,
            "val-aux/response_length/mean": 6.0,
        }
    )


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

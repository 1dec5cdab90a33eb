"""Summable step statistics: one row per record, the fields in declaration order, back again."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import pytest

from megarl.actor.train_stats import OptimizerStepStats
from megarl.algo.rollout_correction import MismatchStats
from megarl.algo.routing_mismatch import RoutingMismatch
from megarl.algo.summable import SummableStats, maximum
from megarl.critic.value_stats import CriticStepStats


@dataclass(frozen=True)
class Counts(SummableStats):
    tokens: float = 0.0
    loss: float = 0.0
    hits: float = 0.0


@dataclass(frozen=True)
class WithExtremes(SummableStats):
    peak: float = maximum()
    tokens: float = 0.0
    neg_low: float = maximum()
    loss: float = 0.0


@dataclass(frozen=True)
class IntCount(SummableStats):
    loss: float = 0.0
    steps: int = 0


def test_the_row_is_the_fields_in_declaration_order_and_round_trips() -> None:
    a = Counts(tokens=4.0, loss=0.5, hits=1.0)
    assert a.to_row() == [4.0, 0.5, 1.0]
    assert a.max_row() == []
    assert Counts.from_row(a.to_row()) == a
    assert Counts.from_row([1, 2, 3]) == Counts(1.0, 2.0, 3.0)
    assert all(type(v) is float for v in Counts.from_row([1, 2, 3]).to_row())


def test_two_records_add_field_wise_like_their_summed_rows() -> None:
    a, b = Counts(4.0, 0.5, 1.0), Counts(6.0, 0.25, 0.0)
    assert a + b == Counts(10.0, 0.75, 1.0)
    summed = [x + y for x, y in zip(a.to_row(), b.to_row(), strict=True)]
    assert Counts.from_row(summed) == a + b
    assert Counts() + a == a
    assert isinstance(a + b, Counts)


def test_maximum_fields_travel_in_their_own_row_and_add_by_maximum() -> None:
    a = WithExtremes(peak=2.0, tokens=3.0, neg_low=-0.5, loss=1.0)
    b = WithExtremes(peak=1.5, tokens=1.0, neg_low=-0.25, loss=0.5)
    assert a.to_row() == [3.0, 1.0]
    assert a.max_row() == [2.0, -0.5]
    assert WithExtremes.from_row(a.to_row(), a.max_row()) == a
    assert a + b == WithExtremes(peak=2.0, tokens=4.0, neg_low=-0.25, loss=1.5)
    assert WithExtremes() == WithExtremes(peak=-math.inf, neg_low=-math.inf)
    assert WithExtremes() + a == a


def test_a_row_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 3 statistics and 0 maxima, got 2 and 0"):
        Counts.from_row([1.0, 2.0])
    with pytest.raises(ValueError, match="expected 2 statistics and 2 maxima, got 2 and 0"):
        WithExtremes.from_row([1.0, 2.0])


def test_a_field_that_is_not_a_float_is_refused() -> None:
    with pytest.raises(TypeError, match=r"IntCount\.steps is int: .* must be a float"):
        IntCount().to_row()
    with pytest.raises(TypeError, match="IntCount.steps"):
        IntCount.from_row([1.0, 2.0])


def test_another_class_does_not_add() -> None:
    with pytest.raises(TypeError):
        Counts() + WithExtremes()  # type: ignore[operator]


@pytest.mark.parametrize(
    "cls", [RoutingMismatch, MismatchStats, CriticStepStats, OptimizerStepStats]
)
def test_the_step_statistics_round_trip_every_field(cls: type[SummableStats]) -> None:
    """Distinct values in every field: a row that drops, doubles or reorders one fails."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    record = cls(**{name: float(i + 1) for i, name in enumerate(names)})
    assert len(record.to_row()) + len(record.max_row()) == len(names)
    assert cls.from_row(record.to_row(), record.max_row()) == record
    doubled = cls.from_row([2 * v for v in record.to_row()], record.max_row())
    assert record + record == doubled

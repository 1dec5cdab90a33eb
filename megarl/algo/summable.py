"""Summable step statistics: a frozen dataclass of float sums that crosses ranks as one row.

A step's statistics (losses, token counts, routing and mismatch counts) are summed on each rank
over its micro-batches, then over every rank with a single all-reduce of one row of floats per
record, and only then divided into metrics, so a ratio is the whole step's, not a mean of the
ranks'. :class:`SummableStats` is that round trip once, driven by :func:`dataclasses.fields`
so that a new field needs no code of its own:

- :meth:`SummableStats.to_row`: the summed fields' values, in declaration order;
- :meth:`SummableStats.max_row`: the fields declared with :func:`maximum`, in declaration order
  (reduced with an element-wise maximum instead: an extreme does not add up; store a minimum
  negated);
- :meth:`SummableStats.from_row`: the record again from the reduced row(s);
- ``a + b``: the field-wise sum (maximum for :func:`maximum` fields), e.g. over micro-batches.

Every field must be annotated ``float``: the row is float64 on the wire, so an ``int`` or a
tensor would come back as something else, and the class is refused (``TypeError``) on first use.

Pure Python: no torch, no distributed; the all-reduce itself is the caller's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, Self

_REDUCE = "megarl.summable.reduce"
"""Field metadata key: ``"max"`` for a field reduced by maximum (absent: summed)."""


def maximum(default: float = -math.inf) -> Any:
    """A field reduced by element-wise maximum over ranks (and by ``max`` in ``+``); its default
    is the maximum's identity, ``-inf``."""
    return dataclasses.field(default=default, metadata={_REDUCE: "max"})


@cache
def _split_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(summed field names, maximum field names)`` of ``cls``, each in declaration order."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass to be summable")
    sums: list[str] = []
    maxima: list[str] = []
    for f in dataclasses.fields(cls):
        if f.type not in ("float", float):
            raise TypeError(
                f"{cls.__name__}.{f.name} is {f.type}: a summable statistic must be a float"
            )
        (maxima if f.metadata.get(_REDUCE) == "max" else sums).append(f.name)
    return tuple(sums), tuple(maxima)


class SummableStats:
    """Mixin for a frozen dataclass of ``float`` statistics summed over micro-batches and ranks
    (see the module docstring)."""

    __slots__ = ()

    def to_row(self) -> list[float]:
        """The summed fields, in declaration order: this rank's row of the all-reduce."""
        sums, _ = _split_fields(type(self))
        return [float(getattr(self, name)) for name in sums]

    def max_row(self) -> list[float]:
        """The :func:`maximum` fields, in declaration order (empty when there are none)."""
        _, maxima = _split_fields(type(self))
        return [float(getattr(self, name)) for name in maxima]

    @classmethod
    def from_row(cls, row: Sequence[float], max_row: Sequence[float] = ()) -> Self:
        """The record of a reduced :meth:`to_row` (and :meth:`max_row`, when it has maxima)."""
        sums, maxima = _split_fields(cls)
        if len(row) != len(sums) or len(max_row) != len(maxima):
            raise ValueError(
                f"{cls.__name__}: expected {len(sums)} statistics and {len(maxima)} maxima, "
                f"got {len(row)} and {len(max_row)}"
            )
        build: Callable[..., Self] = cls
        values = zip((*sums, *maxima), (*row, *max_row), strict=True)
        return build(**{name: float(value) for name, value in values})

    def __add__(self, other: Self) -> Self:
        """Field-wise: the sum of summed fields, the maximum of :func:`maximum` fields."""
        if type(other) is not type(self):
            return NotImplemented
        sums = [a + b for a, b in zip(self.to_row(), other.to_row(), strict=True)]
        maxima = [max(a, b) for a, b in zip(self.max_row(), other.max_row(), strict=True)]
        return type(self).from_row(sums, maxima)

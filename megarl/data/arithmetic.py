"""A seeded, built-in arithmetic task: the default workload, needing no downloaded data."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from megarl.data.problems import Problem

SUPPORTED_OPS: tuple[str, ...] = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticTask:
    """An infinite, reproducible stream of small arithmetic questions.

    Problem ``i`` is a pure function of ``(seed, i)``, so the stream needs no state beyond an
    index to be resumed after a checkpoint, and any logged ``source`` can be regenerated.
    Operands are small on purpose: a 135M model should get them right only sometimes, so a
    GRPO group of responses has mixed rewards and therefore a non-zero advantage signal.

    A held-out set (``held_out`` problems, drawn from a stream of their own) is never trained
    on: a training draw that lands on one of them is drawn again from the same generator, so
    validation on it measures what the model learned, not what it saw.

    Attributes:
        seed: Selects the stream; different seeds give different problems.
        max_operand: Operands are drawn uniformly from ``1..max_operand``.
        ops: Operators to draw from, a subset of ``("+", "-", "*")``.
        held_out: Distinct problems kept for validation (``data.val_problems``); 0 = none.
    """

    seed: int
    max_operand: int = 20
    ops: tuple[str, ...] = ("+",)
    held_out: int = 0
    _held_out_keys: frozenset[tuple[str, int, int]] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        """Validate eagerly so a bad config fails at startup, not at the first step."""
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if isinstance(self.max_operand, bool) or not isinstance(self.max_operand, int):
            raise ValueError(f"max_operand must be an int, got {self.max_operand!r}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if isinstance(self.ops, str):
            raise ValueError(f"ops must be a sequence of operators, not the string {self.ops!r}")
        # Config systems hand over lists; freeze them so the dataclass stays hashable.
        ops = tuple(self.ops)
        object.__setattr__(self, "ops", ops)
        if not ops:
            raise ValueError(f"ops must not be empty; choose from {list(SUPPORTED_OPS)}")
        unknown = [op for op in ops if op not in SUPPORTED_OPS]
        if unknown:
            raise ValueError(f"ops has unsupported {unknown}; choose from {list(SUPPORTED_OPS)}")
        distinct = len(set(ops)) * self.max_operand**2
        if not 0 <= self.held_out <= distinct // 4:
            raise ValueError(
                f"data.val_problems={self.held_out}: must be between 0 and a quarter of the "
                f"{distinct} arithmetic problems there are (data.max_operand, data.ops)"
            )
        object.__setattr__(self, "_held_out_keys", frozenset(self._held_out_draws()))

    def validation_problems(self) -> list[Problem]:
        """The held-out problems, in a fixed order (the same for every run with this seed)."""
        return [
            _problem(op, left, right, f"arithmetic-held-out#{i}")
            for i, (op, left, right) in enumerate(self._held_out_draws())
        ]

    def _held_out_draws(self) -> list[tuple[str, int, int]]:
        draws: dict[tuple[str, int, int], None] = {}  # insertion-ordered set
        rng = random.Random(f"{self.seed}:held-out")
        while len(draws) < self.held_out:
            draws[self._draw(rng)] = None
        return list(draws)

    def _draw(self, rng: random.Random) -> tuple[str, int, int]:
        op = rng.choice(self.ops)
        left = rng.randint(1, self.max_operand)
        right = rng.randint(1, self.max_operand)
        if op == "-" and right > left:
            # Keep results non-negative: negative answers are markedly harder for tiny models.
            left, right = right, left
        return op, left, right

    def problem(self, index: int) -> Problem:
        """Return problem ``index`` of this task's stream (the same on every call)."""
        if index < 0:
            raise ValueError(f"problem index must be >= 0, got {index}")
        # A string seed is hashed with SHA-512 by `random`, so it is stable across processes
        # and Python runs (unlike hash()) and neighbouring indices are uncorrelated.
        rng = random.Random(f"{self.seed}:{index}")
        drawn = self._draw(rng)
        while drawn in self._held_out_keys:
            drawn = self._draw(rng)
        return _problem(*drawn, f"arithmetic#{index}")

    def problems(self, start: int, num_problems: int) -> list[Problem]:
        """Return ``num_problems`` consecutive problems starting at index ``start``."""
        return [self.problem(index) for index in range(start, start + num_problems)]


def _problem(op: str, left: int, right: int, source: str) -> Problem:
    return Problem(
        prompt=f"What is {left} {op} {right}? Answer with just the number.",
        answer=str(_apply(op, left, right)),
        source=source,
    )


def _apply(op: str, left: int, right: int) -> int:
    """Evaluate ``left op right`` for one of the supported operators."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    raise ValueError(f"unsupported operator {op!r}")

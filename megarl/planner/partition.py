"""Cost model, balanced k-way partitioning and micro-batch packing for the batch planner.

Pure numpy + stdlib; no knowledge of RL. Three pieces:

* :func:`sequence_costs` -- estimated forward+backward cost of a sequence of ``t`` tokens,
  ``t + attention_cost_coef * t**2``. Dense matmuls cost ``~6 * num_params`` FLOPs per token
  (``~72 * num_layers * hidden**2`` for a standard transformer), causal attention scores cost
  ``~6 * num_layers * hidden * t**2`` per sequence, so the ratio is ``t**2 / (12 * hidden)``:
  :func:`attention_cost_coef_for` gives ``1 / (12 * hidden)``. Only the relative order of costs
  matters to the partitioner, so a rough coefficient is fine; ``0`` balances plain token counts.

* :func:`balanced_partition` -- split items into ``num_parts`` sets of near-equal total cost.
  Longest-processing-time first (LPT): items in decreasing cost, each to the currently lightest
  part (a heap; ~10 ms for 16k items in CPython). LPT's residual imbalance is about the size of
  the last, smallest items it places, so with tens of items per part it is within a fraction
  of a percent of perfect. A refinement pass then repeatedly moves or swaps one item between the
  heaviest and the lightest part while that lowers the heaviest load, until the heaviest part is
  within 0.1% of the mean (this mostly matters with few items per part, where LPT is weakest).
  Karmarkar-Karp's k-way differencing balances slightly better with very few items per part but
  costs ``O(n * k log k)``, too slow for 65k sequences over 512 ranks.

* :func:`first_fit_decreasing` -- pack item sizes into bins of a token budget; an item larger
  than the budget gets a bin of its own. :func:`split_to_count` then splits the most crowded
  bins (:func:`split_in_two`) until there are as many as wanted, so parts can run equally many
  bins without padding.

Determinism: every sort is stable and keyed on (value, index), so equal inputs give equal
outputs and ties always go to the lower index / lower part number.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

# The default ``attention_cost_coef``: 1 / (12 * hidden) for hidden = 2048 (a ~1-3B model).
DEFAULT_ATTENTION_COST_COEF = 1.0 / (12 * 2048)

# Refinement stops once the heaviest part is within this factor of the mean load.
_REFINE_TARGET_RATIO = 1.001


def attention_cost_coef_for(hidden_size: int) -> float:
    """The ``attention_cost_coef`` matching a transformer of width ``hidden_size``."""
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be positive, got {hidden_size}")
    return 1.0 / (12 * hidden_size)


def sequence_costs(num_tokens: np.ndarray, attention_cost_coef: float) -> np.ndarray:
    """Estimated relative compute cost per sequence: ``t + coef * t**2`` (float64)."""
    tokens = np.asarray(num_tokens, dtype=np.float64)
    return tokens + attention_cost_coef * tokens * tokens


def balanced_partition(costs: np.ndarray, num_parts: int) -> list[np.ndarray]:
    """Split item positions ``0..len(costs)-1`` into ``num_parts`` sets of near-equal cost.

    Returns one ascending int64 array of positions per part; parts may be empty only when there
    are fewer items than parts (the lightest parts stay empty, the first parts are filled first).
    """
    if num_parts <= 0:
        raise ValueError(f"num_parts must be positive, got {num_parts}")
    costs = np.asarray(costs, dtype=np.float64)
    owner = _assign_longest_first(costs, num_parts)
    _refine_heaviest_against_lightest(costs, owner, num_parts)
    return _positions_per_part(owner, num_parts)


def _assign_longest_first(costs: np.ndarray, num_parts: int) -> np.ndarray:
    """LPT: each item, in decreasing cost, goes to the currently lightest part (heap)."""
    heap = [(0.0, part) for part in range(num_parts)]
    owner = [0] * len(costs)
    cost_of = costs.tolist()
    for item in np.argsort(-costs, kind="stable").tolist():
        load, part = heap[0]
        owner[item] = part
        heapq.heapreplace(heap, (load + cost_of[item], part))
    return np.asarray(owner, dtype=np.int64)


def _refine_heaviest_against_lightest(costs: np.ndarray, owner: np.ndarray, num_parts: int) -> None:
    """Move or swap single items from the heaviest to the lightest part while that helps.

    Each pass picks the best exchange between the two extreme parts: give away one item ``a`` of
    the heaviest part and take back ``b`` (an item of the lightest part, or nothing), choosing the
    ``cost[a] - cost[b]`` that minimises the larger of the two new loads. Stops when no exchange
    lowers the heaviest load, when it is within ``_REFINE_TARGET_RATIO`` of the mean, or after
    ``2 * num_parts`` passes. Mutates ``owner`` in place.
    """
    if num_parts < 2 or len(costs) == 0:
        return
    loads = np.bincount(owner, weights=costs, minlength=num_parts)
    target_max = _REFINE_TARGET_RATIO * loads.mean()
    for _ in range(2 * num_parts):
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        if loads[heavy] <= target_max:
            return
        exchange = _best_exchange(costs, owner, heavy, light, loads)
        if exchange is None:
            return
        given, taken = exchange
        owner[given] = light
        loads[heavy] -= costs[given]
        loads[light] += costs[given]
        if taken is not None:
            owner[taken] = heavy
            loads[heavy] += costs[taken]
            loads[light] -= costs[taken]


def _best_exchange(
    costs: np.ndarray, owner: np.ndarray, heavy: int, light: int, loads: np.ndarray
) -> tuple[int, int | None] | None:
    """The (item given by ``heavy``, item or None given back by ``light``) that helps most."""
    heavy_items = np.flatnonzero(owner == heavy)
    light_items = np.flatnonzero(owner == light)
    given_costs = costs[heavy_items]
    taken_costs = np.concatenate(([0.0], costs[light_items]))  # position 0: take nothing back
    delta = given_costs[:, None] - taken_costs[None, :]
    new_max = np.maximum(loads[heavy] - delta, loads[light] + delta)
    best = int(np.argmin(new_max))  # row-major first minimum: lowest indices win ties
    if new_max.flat[best] >= loads[heavy] * (1.0 - 1e-12):
        return None
    row, col = divmod(best, len(taken_costs))
    taken = None if col == 0 else int(light_items[col - 1])
    return int(heavy_items[row]), taken


def _positions_per_part(owner: np.ndarray, num_parts: int) -> list[np.ndarray]:
    """Invert the item -> part map into ascending position arrays per part."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(num_parts + 1))
    return [order[bounds[p] : bounds[p + 1]] for p in range(num_parts)]


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack positions ``0..len(sizes)-1`` into bins whose sizes sum to at most ``capacity``.

    Items go in decreasing size (ties by position) into the first bin with room; an item larger
    than ``capacity`` opens a bin that nothing else joins. Bins are returned in opening order.
    """
    # sorted() is stable also with reverse=True: equal sizes keep ascending positions
    order = sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True)
    bins: list[list[int]] = []
    room: list[int] = []
    for position in order:
        size = sizes[position]
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(position)
                room[b] = free - size
                break
        else:
            bins.append([position])
            room.append(capacity - size)  # negative for an over-long item: stays closed
    return bins


def split_in_two(positions: Sequence[int], sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split a bin of at least two items into two non-empty halves of near-equal size."""
    if len(positions) < 2:
        raise ValueError(f"cannot split a bin of {len(positions)} item(s)")
    order = sorted(positions, key=lambda position: (-sizes[position], position))
    halves: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for position in order:
        side = _lighter_half(halves, totals)
        halves[side].append(position)
        totals[side] += sizes[position]
    return halves


def _lighter_half(halves: tuple[list[int], list[int]], totals: list[int]) -> int:
    """Index of the half to grow next: an empty half first, then the lighter one (ties: 0)."""
    if not halves[0] or not halves[1]:
        return 0 if not halves[0] else 1
    return 0 if totals[0] <= totals[1] else 1


def split_to_count(bins: list[list[int]], num_wanted: int, sizes: Sequence[int]) -> list[list[int]]:
    """Split the most crowded bins until there are ``num_wanted`` (or none splits).

    Each split halves one bin of at least two items (the one with the most items, ties: the
    first) by :func:`split_in_two`; the bins' contents are unchanged, only regrouped.
    """
    bins = list(bins)
    while len(bins) < num_wanted:
        splittable = [b for b, items in enumerate(bins) if len(items) >= 2]
        if not splittable:
            break
        crowded = max(splittable, key=lambda b: (len(bins[b]), -b))
        bins[crowded : crowded + 1] = split_in_two(bins[crowded], sizes)
    return bins

"""How fast the batch planner plans, and how well it balances DP ranks, as the batch grows.

Run: ``python benchmarks/bench_planner_scaling.py [--repeats 5]`` (CPU only, a few seconds).

Synthetic GRPO batches: groups of 16 samples, ~75% of groups all-equal (advantage 0), sequence
lengths log-normal with mean ~1000 tokens (sigma 0.8, clipped to [16, 8192]), micro-batch budget
16384 tokens, default cost model ``t + t**2 / 24576``. For each size the table shows the median
(and best) wall time of :func:`plan_step` on already-built :class:`PlannerInputs`, the time to
build and validate those inputs, and the DP imbalance (slowest rank's estimated cost over the mean
trained cost per rank, summed over steps) of the planner next to a naive contiguous split -- the
same steps, each step's kept sequences cut in index order into ``dp_size`` equal-count chunks, as
a trainer that shards by position does. Targets (the last row, 65,536 sequences over 512 ranks,
``ppo_mini_batches=1``, ``match_loss_curve``): plan < 100 ms, imbalance <= 1.02 vs naive >= 1.2.
The verdict uses the best wall time of the repeats, the usual noise-robust estimate on a shared
machine; the median wall and CPU times are printed beside it. "inputs" is the one-off cost of
building and validating :class:`PlannerInputs` from numpy arrays, not part of planning.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import PlannerInputs
from megarl.planner.partition import sequence_costs
from megarl.planner.step_plan import StepPlan

GROUP_SIZE = 16
ZERO_ADV_GROUP_FRAC = 0.75
MEAN_SEQ_TOKENS = 1000
SIGMA = 0.8
MICRO_BATCH_TOKENS = 16384

TARGET_PLAN_MS = 100.0
TARGET_IMBALANCE = 1.02
EXPECTED_NAIVE_IMBALANCE = 1.2


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    num_sequences: int
    """Sequences in the rollout batch."""
    dp_size: int
    """Data-parallel ranks."""
    mode: str = "match_loss_curve"
    """Planner mode."""
    ppo_mini_batches: int = 1
    """Baseline optimizer steps per epoch."""


CASES = (
    Case(4096, 32),
    Case(16384, 128),
    Case(16384, 128, mode="fast", ppo_mini_batches=4),
    Case(65536, 512, mode="off"),
    Case(65536, 512, mode="fast", ppo_mini_batches=4),
    Case(65536, 512),  # the target row
)


def synthetic_arrays(num_sequences: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-sequence arrays of a GRPO rollout batch with log-normal lengths."""
    rng = np.random.default_rng(seed)
    log_mean = np.log(MEAN_SEQ_TOKENS) - SIGMA**2 / 2
    seq_tokens = np.clip(rng.lognormal(log_mean, SIGMA, num_sequences), 16, 8192).astype(np.int64)
    group_ids = np.arange(num_sequences) // GROUP_SIZE
    group_all_equal = rng.random(group_ids[-1] + 1) < ZERO_ADV_GROUP_FRAC
    advantages = np.where(group_all_equal[group_ids], 0.0, rng.normal(size=num_sequences))
    return {
        "seq_tokens": seq_tokens,
        "response_tokens": np.maximum(1, seq_tokens - rng.integers(50, 400, num_sequences)),
        "advantages": advantages,
        "group_ids": group_ids,
    }


def build_inputs(case: Case, arrays: dict[str, np.ndarray]) -> PlannerInputs:
    return PlannerInputs(
        **arrays,
        dp_size=case.dp_size,
        ppo_mini_batches=case.ppo_mini_batches,
        micro_batch_tokens=MICRO_BATCH_TOKENS,
        mode=case.mode,
    )


def naive_contiguous_imbalance(inputs: PlannerInputs, plan: StepPlan) -> float:
    """``StepPlan.dp_imbalance`` had each step's trained sequences been cut by position.

    Same steps and trained sequences as ``plan``; each step's kept sequences are split in index
    order into ``dp_size`` chunks of equal count (no fillers, no micro-batching).
    """
    costs = sequence_costs(np.asarray(inputs.seq_tokens), inputs.attention_cost_coef)
    size = inputs.num_sequences // inputs.ppo_mini_batches
    kept = np.ones(len(costs), bool) if inputs.mode == "off" else np.asarray(inputs.advantages) != 0
    slowest = ideal = 0.0
    for step in plan.optimizer_steps:
        runs = step.source_mini_batches
        members = np.arange(runs[0] * size, (runs[-1] + 1) * size)
        trained_costs = costs[members[kept[members]]]
        if len(trained_costs):
            slowest += max(chunk.sum() for chunk in np.array_split(trained_costs, inputs.dp_size))
            ideal += trained_costs.sum() / inputs.dp_size
    return slowest / ideal if ideal else 1.0


@dataclass(frozen=True)
class Timing:
    """Milliseconds over the timed calls of one function."""

    wall_ms: tuple[float, ...]
    """Wall-clock time per call."""
    cpu_ms: tuple[float, ...]
    """Process CPU time per call (less sensitive to other jobs sharing the cores)."""

    @property
    def best_ms(self) -> float:
        """Fastest wall time: the usual noise-robust estimate (as ``timeit`` recommends)."""
        return min(self.wall_ms)


def timed(function, repeats: int) -> tuple[Timing, object]:
    """Time ``repeats`` calls after one warm-up call; return the timing and the last result."""
    result = function()
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        result = function()
        wall.append((time.perf_counter() - wall_start) * 1e3)
        cpu.append((time.process_time() - cpu_start) * 1e3)
    return Timing(tuple(wall), tuple(cpu)), result


HEADER = (
    f"{'seqs':>6} {'dp':>4} {'mode':<16} {'M':>2} {'kept':>6} {'steps':>5} {'mb/rk':>5} "
    f"{'fill':>4} | {'best ms':>7} {'median':>7} {'cpu ms':>7} {'inputs':>7} | {'imb':>6} "
    f"{'naive':>6} {'naive/imb':>9}"
)


def format_row(case: Case, plan: StepPlan, timing: Timing, inputs_ms: float, naive: float) -> str:
    mb_per_rank = max(step.num_micro_batches_per_rank for step in plan.optimizer_steps)
    return (
        f"{case.num_sequences:>6} {case.dp_size:>4} {case.mode:<16} {case.ppo_mini_batches:>2} "
        f"{plan.metrics['planner/kept_seq_frac']:>6.1%} {len(plan.optimizer_steps):>5} "
        f"{mb_per_rank:>5} {plan.num_filler_seqs:>4} | {timing.best_ms:>7.1f} "
        f"{statistics.median(timing.wall_ms):>7.1f} {statistics.median(timing.cpu_ms):>7.1f} "
        f"{inputs_ms:>7.1f} | {plan.dp_imbalance:>6.3f} {naive:>6.3f} "
        f"{naive / plan.dp_imbalance:>9.2f}"
    )


def print_verdicts(plan: StepPlan, timing: Timing, naive: float) -> None:
    """PASS/MISS against the targets, for the target row."""
    print(f"target row: {plan.summary()}")
    verdicts = [
        (
            "plan 65,536 seqs / 512 ranks",
            f"{timing.best_ms:.1f} ms",
            "< 100 ms",
            timing.best_ms < TARGET_PLAN_MS,
        ),
        (
            "planner dp_imbalance",
            f"{plan.dp_imbalance:.4f}",
            f"<= {TARGET_IMBALANCE}",
            plan.dp_imbalance <= TARGET_IMBALANCE,
        ),
        (
            "naive contiguous dp_imbalance",
            f"{naive:.4f}",
            f">= {EXPECTED_NAIVE_IMBALANCE}",
            naive >= EXPECTED_NAIVE_IMBALANCE,
        ),
        ("naive / planner imbalance", f"{naive / plan.dp_imbalance:.2f}x", "", True),
    ]
    for name, value, target, ok in verdicts:
        verdict = ("PASS" if ok else "MISS") if target else ""
        print(f"  {name:<30} {value:>10}  {target:<9} {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case")
    args = parser.parse_args()
    print(HEADER)
    print("-" * len(HEADER))
    for case in CASES:
        arrays = synthetic_arrays(case.num_sequences)
        inputs_timing, inputs = timed(partial(build_inputs, case, arrays), 1)
        timing, plan = timed(partial(plan_step, inputs), args.repeats)
        assert isinstance(inputs, PlannerInputs) and isinstance(plan, StepPlan)
        naive = naive_contiguous_imbalance(inputs, plan)
        print(format_row(case, plan, timing, inputs_timing.best_ms, naive))
    print()
    print_verdicts(plan, timing, naive)


if __name__ == "__main__":
    main()

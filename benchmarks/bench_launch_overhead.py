"""Ray's own overhead: the same tiny run under ``trainer.launcher=local`` and ``=ray``.

Prints, side by side, the wall time of the whole run, the start-up overhead (wall time minus the
time spent inside training steps: process/actor start, Ray start-up, placement, model build and
teardown) and the mean step time (steps 2.. ; step 1 includes warm-up). The step loop runs inside
the ranks under both launchers, so the per-step controller overhead of Ray is the step-time
difference, expected to be ~0.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_launch_overhead.py [--ranks 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))


@dataclass(frozen=True)
class LaunchTiming:
    launcher: str
    wall_s: float
    step_s: list[float]

    @property
    def startup_s(self) -> float:
        return self.wall_s - sum(self.step_s)

    @property
    def mean_step_s(self) -> float:
        steady = self.step_s[1:] or self.step_s
        return statistics.mean(steady)


def time_run(launcher: str, ranks: int, steps: int, tp: int) -> LaunchTiming:
    from conftest import tiny_overrides

    from megarl.train import run

    with tempfile.TemporaryDirectory(prefix=f"bench-{launcher}-") as tmp:
        overrides = tiny_overrides(
            Path(tmp) / "run",
            steps=steps,
            **{"trainer.launcher": launcher, "trainer.n_gpus_per_node": ranks, "actor.tp": tp},
        )
        start = time.perf_counter()
        result = run(overrides)
        wall = time.perf_counter() - start
    return LaunchTiming(launcher, wall, [row["timing_s/step"] for row in result.history])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    timings = [time_run(name, args.ranks, args.steps, args.tp) for name in ("local", "ray")]
    print(f"\ntiny_llama, {args.ranks} ranks (TP={args.tp}), {args.steps} steps, CPU")
    print(f"{'launcher':<8} {'wall s':>8} {'start-up s':>11} {'step s (2..)':>13} {'steps':>24}")
    for t in timings:
        steps = " ".join(f"{s:.2f}" for s in t.step_s)
        print(
            f"{t.launcher:<8} {t.wall_s:8.2f} {t.startup_s:11.2f} {t.mean_step_s:13.2f} {steps:>24}"
        )
    local, ray = timings
    print(
        f"ray - local: start-up {ray.startup_s - local.startup_s:+.2f} s, "
        f"per step {ray.mean_step_s - local.mean_step_s:+.3f} s"
    )


if __name__ == "__main__":
    main()

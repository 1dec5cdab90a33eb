"""Synchronous vs asynchronous training, side by side in one run: throughput and idle time.

Run: ``python benchmarks/bench_async.py [--steps 10] [--modes sync one_step_off fully_async:1
fully_async:2 fully_async:2:partial] [--engine hf] [--repeats 1]``

Each mode trains the embedded default (SmolLM2-135M-Instruct, arithmetic, 4 prompts x 8
samples, 12 new tokens) in split placement (``trainer.launcher=ray rollout.n_gpus=1``). On one
CPU machine split placement gives the rollout actor one core of its own and the trainer the
other (the CPU analogue of separate GPU pools, printed at start-up): in ``sync`` each side waits
while the other works, the asynchronous modes overlap them. Modes run one after the other
(``--repeats`` rounds, modes interleaved within a round, so all see the machine alike).

Per mode, from the run's ``metrics.jsonl``:

* **tokens/s**: the batches' tokens (prompt + response, what a step trains on) over the steps'
  wall time, steps 2.. (step 1 waits for the first batch in every mode) and, in brackets, all;
* **trainer idle**: the share of the step the trainer waited for data (``timing_s/wait_rollout``;
  in sync the generation and scoring, which it waits for);
* **rollout idle**: the share of its own time the rollout side waited (``timing_s/rollout_idle``
  over itself plus generating and scoring; in sync everything but generating and scoring);
* the largest ``async/staleness/max`` and the reward curve (``critic/rewards/mean``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mode:
    name: str
    overrides: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Mode:
        """``sync`` | ``one_step_off`` | ``fully_async:K`` | ``fully_async:K:partial``."""
        mode, *rest = spec.split(":")
        overrides = [f"async_training.mode={mode}"]
        if rest:
            overrides.append(f"async_training.max_staleness={rest[0]}")
        if rest[1:] == ["partial"]:
            overrides.append("async_training.partial_rollout=true")
        return cls(spec, tuple(overrides))


def run_mode(
    mode: Mode, steps: int, engine: str, run_dir: Path, overrides: list[str]
) -> tuple[list[dict], float]:
    command = [
        sys.executable,
        "-m",
        "megarl.train",
        f"trainer.total_steps={steps}",
        f"trainer.run_dir={run_dir}",
        "trainer.logger=[jsonl]",
        "trainer.launcher=ray",
        "rollout.n_gpus=1",
        f"rollout.engine={engine}",
        *mode.overrides,
        *overrides,
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - started


PHASES = ("wait_rollout", "gen", "adv", "old_log_prob", "update_actor", "update_weights")
"""The phases whose medians the table shows (gen and adv are the rollout side's in async)."""


@dataclass(frozen=True)
class Summary:
    tokens_per_s: float
    tokens_per_s_all: float
    trainer_idle: float
    rollout_idle: float
    max_staleness: float
    rewards: list[float]
    median_step: float
    phases: dict[str, float]


def summarize(rows: list[dict]) -> Summary:
    steady = rows[1:] or rows
    wall = sum(r["timing_s/step"] for r in steady)
    tokens = sum(r["perf/total_num_tokens"] for r in steady)
    synchronous = "timing_s/wait_rollout" not in rows[0]
    rollout_busy = sum(r["timing_s/gen"] + r["timing_s/adv"] for r in steady)
    if synchronous:  # the trainer waits while the rollout side generates and scores
        trainer_wait, rollout_wait = rollout_busy, wall - rollout_busy
    else:
        trainer_wait = sum(r["timing_s/wait_rollout"] for r in steady)
        rollout_wait = sum(r["timing_s/rollout_idle"] for r in steady)
    return Summary(
        tokens_per_s=tokens / wall,
        tokens_per_s_all=sum(r["perf/total_num_tokens"] for r in rows)
        / sum(r["timing_s/step"] for r in rows),
        trainer_idle=trainer_wait / wall,
        rollout_idle=rollout_wait / (rollout_wait + rollout_busy),
        max_staleness=max(r.get("async/staleness/max", 0.0) for r in rows),
        rewards=[r["critic/rewards/mean"] for r in rows],
        median_step=statistics.median(r["timing_s/step"] for r in steady),
        phases={p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in steady) for p in PHASES},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    parser.add_argument(
        "overrides", nargs="*", help="more megarl-train overrides for every mode (key=value)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "one_step_off", "fully_async:1", "fully_async:2"],
    )
    args = parser.parse_args()
    modes = [Mode.parse(spec) for spec in args.modes]
    results: dict[str, list[Summary]] = {m.name: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="megarl-bench-async-") as tmp:
        root = args.keep or Path(tmp)
        for repeat in range(args.repeats):
            for mode in modes:
                run_dir = root / f"{mode.name.replace(':', '_')}-{repeat}"
                rows, whole = run_mode(mode, args.steps, args.engine, run_dir, args.overrides)
                summary = summarize(rows)
                results[mode.name].append(summary)
                print(
                    f"  {mode.name}: whole run {whole:.0f} s (start-up included), median step "
                    f"{summary.median_step:.1f} s",
                    flush=True,
                )
    base = statistics.median(s.tokens_per_s for s in results[modes[0].name])
    print(
        f"\n{args.engine} engine, {args.steps} steps, split placement (one core each), "
        f"{args.repeats} round(s); medians over rounds"
    )
    print(
        f"{'mode':24} {'tokens/s':>14} {'vs ' + modes[0].name:>10} {'trainer idle':>13} "
        f"{'rollout idle':>13} {'max stale':>10}"
    )
    for mode in modes:
        runs = results[mode.name]
        tps = statistics.median(s.tokens_per_s for s in runs)
        tps_all = statistics.median(s.tokens_per_s_all for s in runs)
        print(
            f"{mode.name:24} {tps:6.1f} ({tps_all:5.1f}) {tps / base:9.2f}x "
            f"{statistics.median(s.trainer_idle for s in runs):12.0%} "
            f"{statistics.median(s.rollout_idle for s in runs):12.0%} "
            f"{max(s.max_staleness for s in runs):10.0f}"
        )
    print(
        "\nmedian seconds per step (gen, adv: the rollout side's; in sync on the trainer's path):"
    )
    print(f"{'mode':24} " + " ".join(f"{p:>14}" for p in PHASES))
    for mode in modes:
        phases = results[mode.name][0].phases
        print(f"{mode.name:24} " + " ".join(f"{phases[p]:14.2f}" for p in PHASES))
    print("\nreward per step (first round):")
    for mode in modes:
        curve = " ".join(f"{r:.2f}" for r in results[mode.name][0].rewards)
        print(f"  {mode.name:24} {curve}")


if __name__ == "__main__":
    main()

"""What the pass gates save: step time with gates ``auto`` vs ``always``, and the reference
model's resident memory.

Run: ``python benchmarks/bench_pass_gates.py [--repeats 3] [key=value ...]`` (Hydra overrides;
default: the embedded SmolLM2-135M-Instruct arithmetic workload, 8 prompts x 8 samples, KL
coefficient 0 as in the default config; a few minutes on 2 CPU cores).

Time. One rollout batch is generated once; ``always`` (old-logprob and reference forwards every
step) and ``auto`` (on-policy, KL 0: both skipped) then run the same step's logprob passes and
update from the same weights (``benchmarks/step_harness.py``), interleaved within each repeat.
Printed: the median trained-part step time of each (logprob passes + update; generation and
weight sync do not depend on the gates), the measured time of the passes ``auto`` skips (from the
``always`` trials), and the fraction of that time actually saved:
``(step_always - step_auto) / skipped_pass_time``. Target: >= 0.90.

Memory. Two fresh processes build the rank-0 runtime of a run (actor, engine, data) with
``actor.kl_coef=0`` (no reference model is built) and with ``actor.kl_coef=0.001`` (it is), and
report their resident set size; the difference is about one model copy (parameters x 4 bytes
in fp32).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_harness import close_harness, median_of, open_harness

DEFAULT_OVERRIDES = ["data.prompts_per_step=8", "rollout.n=8", "trainer.total_steps=1"]
TARGET_SAVED = 0.90
PASS_PHASES = ("timing_s/old_log_prob", "timing_s/ref")
STEP_PHASES = (*PASS_PHASES, "timing_s/update_actor")


def time_gates(overrides: list[str], repeats: int) -> bool:
    harness = open_harness([*DEFAULT_OVERRIDES, "planner.ref_log_prob=always", *overrides])
    modes = {
        "always": harness.with_planner(old_log_prob="always", ref_log_prob="always"),
        "auto": harness.with_planner(old_log_prob="auto", ref_log_prob="auto"),
    }
    steps = {name: [] for name in modes}
    skipped: list[float] = []
    summaries = {}
    try:
        for _ in range(repeats):
            for name, cfg in modes.items():
                timer, _, gates = harness.run_step(cfg)
                steps[name].append(sum(timer.times.get(p, 0.0) for p in STEP_PHASES))
                if name == "always":
                    skipped.append(sum(timer.times.get(p, 0.0) for p in PASS_PHASES))
                summaries[name] = gates.summary()
    finally:
        close_harness(harness)
    t_always, t_auto, t_skipped = (
        median_of(steps["always"]),
        median_of(steps["auto"]),
        median_of(skipped),
    )
    saved = (t_always - t_auto) / t_skipped
    print(
        f"batch: {harness.batch.num_seqs} sequences, {sum(harness.batch.seq_lens)} tokens; "
        f"{repeats} repeats, modes interleaved"
    )
    for name in modes:
        print(
            f"  gates {name:<7} step (logprob passes + update) {median_of(steps[name]):7.2f} s"
            f"   [{summaries[name]}]"
        )
    print(f"  skipped passes (old + ref, measured under always): {t_skipped:.2f} s")
    print(
        f"  saved: {t_always - t_auto:.2f} s = {saved:.1%} of the skipped passes' time "
        f"(target >= {TARGET_SAVED:.0%}): {'ok' if saved >= TARGET_SAVED else 'MISS'}"
    )
    return saved >= TARGET_SAVED


def measure_rss(overrides: list[str], kl_coef: float) -> dict:
    """RSS of a fresh process holding a run's rank-0 runtime (no training)."""
    code = (
        "import json, sys, torch\n"
        "from step_harness import build_runtime_only\n"
        f"rt = build_runtime_only({overrides!r} + ['actor.kl_coef={kl_coef}'])\n"
        "rss = int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])\n"
        "n = sum(p.numel() for p in rt.actor.model.parameters())\n"
        "print(json.dumps({'rss_mb': rss / 1024, 'reference': rt.reference is not None,"
        " 'actor_params': n}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_memory(overrides: list[str]) -> None:
    without = measure_rss(DEFAULT_OVERRIDES + overrides, 0.0)
    with_ref = measure_rss(DEFAULT_OVERRIDES + overrides, 0.001)
    model_mb = without["actor_params"] * 4 / 2**20
    print(
        f"resident memory after start-up: kl_coef=0 -> {without['rss_mb']:.0f} MiB "
        f"(reference built: {without['reference']}); kl_coef=0.001 -> "
        f"{with_ref['rss_mb']:.0f} MiB (reference built: {with_ref['reference']}); "
        f"difference {with_ref['rss_mb'] - without['rss_mb']:.0f} MiB, one fp32 model copy is "
        f"{model_mb:.0f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_llama")
    args = parser.parse_args()
    ok = time_gates(args.overrides, args.repeats)
    if not args.skip_memory:
        compare_memory(args.overrides)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Update time under zero-advantage pruning: ``off`` vs ``match_loss_curve`` vs ``fast``.

Run: ``python benchmarks/bench_update_actor.py [--repeats 3] [key=value ...]`` (Hydra overrides of
the run; default: the embedded SmolLM2-135M-Instruct arithmetic workload with 8 prompts x 8
samples per step, about 3 minutes on 2 CPU cores).

One rollout batch is generated once; every mode then plans and trains that same batch from the
same initial weights and a fresh optimizer (``benchmarks/step_harness.py``), modes interleaved
within each repeat so machine noise hits all of them alike. Printed per mode: median
``timing_s/update_actor``, the kept-token fraction, the ratio of update time to ``off``'s, and the
issue's target ``ratio <= 1.15 x kept_token_frac + 0.05`` -- update time proportional to the
tokens actually trained. The last column is the max |param diff| against ``off`` after the step:
0 (or float noise) for ``match_loss_curve``, by construction; ``fast`` merges mini-batches, so it
only equals ``off`` when there is one mini-batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_harness import close_harness, median_of, open_harness

MODES = ("off", "match_loss_curve", "fast")
DEFAULT_OVERRIDES = ["data.prompts_per_step=8", "rollout.n=8", "trainer.total_steps=1"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_llama")
    args = parser.parse_args()

    harness = open_harness(DEFAULT_OVERRIDES + args.overrides)
    try:
        times = {mode: [] for mode in MODES}
        kept = {}
        params = {}
        for _ in range(args.repeats):
            for mode in MODES:
                timer, plan, _ = harness.run_step(harness.with_planner(prune_zero_adv=mode))
                times[mode].append(timer.times["timing_s/update_actor"])
                kept[mode] = plan.metrics["planner/kept_token_frac"]
                params[mode] = harness.trained_params()
    finally:
        close_harness(harness)

    batch = harness.batch
    print(
        f"batch: {batch.num_seqs} sequences, {sum(batch.seq_lens)} tokens, "
        f"zero-advantage fraction {float((batch.advantages == 0).float().mean()):.2f}; "
        f"{args.repeats} repeats, modes interleaved"
    )
    base = median_of(times["off"])
    print(
        f"{'mode':<18}{'update_s':>10}{'kept_tok':>10}{'ratio':>8}{'target':>8}"
        f"{'verdict':>9}{'max|dW| vs off':>16}"
    )
    ok = True
    for mode in MODES:
        t = median_of(times[mode])
        ratio = t / base
        target = 1.15 * kept[mode] + 0.05 if mode != "off" else 1.0
        passed = mode == "off" or ratio <= target
        ok &= passed
        diff = max(
            (a - b).abs().max().item() for a, b in zip(params[mode], params["off"], strict=True)
        )
        print(
            f"{mode:<18}{t:>10.2f}{kept[mode]:>10.3f}{ratio:>8.3f}{target:>8.3f}"
            f"{'ok' if passed else 'MISS':>9}{diff:>16.2e}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the planner saves per recipe: one step's update phase with every saving off, and on.

Run: ``python benchmarks/bench_recipes.py [--recipes grpo,dr_grpo,...] [key=value ...]``
(Hydra overrides of every run; default: the embedded SmolLM2-135M-Instruct arithmetic workload,
4 prompts x 8 samples, world size 1).

For each recipe file (``configs/recipe/``), two one-step runs from the same seed, hence the same
rollouts: **all** recomputes and trains everything (``planner.prune_zero_adv=off
planner.old_log_prob=always planner.ref_log_prob=always``), **planned** is the default
(``auto``: prune zero-advantage sequences where that is exact for the recipe's estimator, loss
and coefficients; skip the passes no term needs). The update phase is what the planner
decides: the old-logprob and reference passes and the actor's update (``timing_s/old_log_prob
+ timing_s/ref + timing_s/update_actor``). PPO's critic phases (values, critic update) are the
same under both and are printed apart. The planner's own reason (``planner/summary``) says why
a recipe prunes or not: the KL loss of ``grpo`` and the critic of ``ppo`` need every sequence,
and ``dapo``'s dynamic sampling has already dropped the groups whose rewards are all equal.

Single trials, modes back to back per recipe: on a shared machine read the ratio, not the
seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

RECIPES = ("grpo", "dr_grpo", "gspo", "rloo", "dapo", "ppo")
ALL_ON = [
    "planner.prune_zero_adv=off",
    "planner.old_log_prob=always",
    "planner.ref_log_prob=always",
]
UPDATE_PHASE = ("timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")
CRITIC_PHASES = ("timing_s/values", "timing_s/update_critic")
QUIET = ["trainer.total_steps=1", "trainer.log_console=false", "trainer.tensorboard=false"]


@dataclass(frozen=True)
class Trial:
    """One step's numbers under one setting."""

    update_s: float
    critic_s: float
    zero_adv: float
    kept_tokens: float
    summary: str


def trial(recipe: str, extra: list[str], overrides: list[str]) -> Trial:
    from megarl.train import run

    with tempfile.TemporaryDirectory(prefix="megarl-bench-recipe-") as tmp:
        args = [f"recipe={recipe}", f"trainer.run_dir={tmp}/run", *QUIET, *overrides, *extra]
        row = run(args).history[0]
    return Trial(
        update_s=sum(row.get(key, 0.0) for key in UPDATE_PHASE),
        critic_s=sum(row.get(key, 0.0) for key in CRITIC_PHASES),
        zero_adv=row["critic/advantages/zero_adv_ratio"],
        kept_tokens=row["planner/kept_token_frac"],
        summary=str(row["planner/summary"]),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny_llama")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if not (ROOT / "configs" / "recipe" / f"{r}.yaml").exists()]
    if unknown:
        print(f"bench_recipes: no recipe file for {', '.join(unknown)}", file=sys.stderr)
        return 2

    rows = []
    for recipe in recipes:
        everything = trial(recipe, ALL_ON, args.overrides)
        planned = trial(recipe, [], args.overrides)
        rows.append((recipe, everything, planned))
        print(f"{recipe}: done", file=sys.stderr, flush=True)

    print(
        f"{'recipe':<9}{'zero_adv':>9}{'kept_tok':>9}{'all_s':>8}{'planned_s':>10}"
        f"{'saved':>7}{'critic_s':>9}  planner/summary (planned)"
    )
    for recipe, everything, planned in rows:
        saved = 1 - planned.update_s / everything.update_s
        critic = f"{planned.critic_s:9.1f}" if planned.critic_s else f"{'-':>9}"
        print(
            f"{recipe:<9}{planned.zero_adv:9.2f}{planned.kept_tokens:9.2f}"
            f"{everything.update_s:8.1f}{planned.update_s:10.1f}{saved:7.0%}{critic}  "
            f"{planned.summary}"
        )
    return 0


ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    raise SystemExit(main())

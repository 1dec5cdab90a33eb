"""Bytes each rank receives per step for the rollout batch: broadcast of the whole batch (the
old data path) vs the metadata broadcast plus a scatter of each DP rank's planned sequences.

Run: ``python benchmarks/bench_rollout_scatter.py [--prompts 64] [--samples 8] [--seed 0]``
(seconds, no model: the batch is synthetic, the plan is the real planner's).

``torch.distributed``'s object collectives send each object as its pickle, so the pickle size
is what moves: before, every rank received ``pickle((batch, metrics, phase_seconds,
engine_state))``; after, every rank receives the metadata (``batch.shard(())`` with the same
metrics) plus ``pickle(batch.shard(plan.sequences_on_rank(dp)))``. A fifth of the groups get
equal rewards (zero advantage) so the planner prunes as it does in a run. Printed per DP size:
the bytes of the largest per-rank receipt before and after and their ratio, and the bytes
leaving rank 0 in all. Target: bytes per rank fall roughly as 1/DP, i.e. stay flat per
sequence trained.
"""

from __future__ import annotations

import argparse
import pickle

import torch

from megarl.batch import RolloutBatch
from megarl.config.planning import batch_facts
from megarl.engines.base import EngineMemoryState
from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import PlannerInputs

PROMPT_TOKENS = 256
MAX_RESPONSE = 1024


def synthetic_batch(prompts: int, samples: int, seed: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens, prompt_lens, logprobs, advantages = [], [], [], []
    for p in range(prompts):
        zero_group = p % 5 == 0
        group_adv = torch.zeros(samples) if zero_group else torch.randn(samples, generator=gen)
        for s in range(samples):
            response = int(torch.randint(64, MAX_RESPONSE + 1, (1,), generator=gen))
            tokens.append(torch.randint(0, 49152, (PROMPT_TOKENS + response,), generator=gen))
            prompt_lens.append(PROMPT_TOKENS)
            logprobs.append(-torch.rand(response, generator=gen))
            advantages.append(float(group_adv[s]))
    n = prompts * samples
    return RolloutBatch(
        tokens=tuple(tokens),
        prompt_lens=tuple(prompt_lens),
        group_ids=torch.arange(prompts).repeat_interleave(samples),
        rewards=torch.zeros(n),
        advantages=torch.tensor(advantages),
        engine_logprobs=tuple(logprobs),
    )


def sizes(batch: RolloutBatch, dp: int) -> tuple[int, int, int]:
    """(bytes per rank before, largest bytes per rank after, bytes leaving rank 0 after)."""
    metrics = {f"rollout/metric_{i}": float(i) for i in range(40)}
    extra = (
        metrics,
        {"gen": 1.0},
        EngineMemoryState(base_weights_resident=True, adapter_resident=False),
    )
    before = len(pickle.dumps((batch, *extra)))
    plan = plan_step(
        PlannerInputs(
            **batch_facts(batch),
            dp_size=dp,
            ppo_mini_batches=4,
            mode="match_loss_curve",
        )
    )
    header = len(pickle.dumps((batch.shard(()), *extra)))
    shards = [len(pickle.dumps(batch.shard(plan.sequences_on_rank(r)))) for r in range(dp)]
    return before, header + max(shards), dp * header + sum(shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    batch = synthetic_batch(args.prompts, args.samples, args.seed)
    print(
        f"batch: {batch.num_seqs} sequences, {sum(batch.seq_lens)} tokens "
        f"(prompt {PROMPT_TOKENS}, response 64..{MAX_RESPONSE})"
    )
    print(
        f"{'DP':>3} {'per rank before':>16} {'per rank after':>15} {'after/before':>13} "
        f"{'rank 0 sends before':>20} {'after':>12}"
    )
    for dp in (1, 2, 4):
        before, after, sent = sizes(batch, dp)
        print(
            f"{dp:>3} {before / 2**20:>14.2f}MB {after / 2**20:>13.2f}MB {after / before:>13.2f} "
            f"{dp * before / 2**20:>18.2f}MB {sent / 2**20:>10.2f}MB"
        )


if __name__ == "__main__":
    main()

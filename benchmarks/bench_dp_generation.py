"""The Megatron engine with data-parallel replicas sharing each call, against one replica
generating alone, side by side in one run.

Run: ``python benchmarks/bench_dp_generation.py [--repeats 5] [--prompts 8] [--new-tokens 32]``
(CPU; the packaged SmolLM2-135M-Instruct in fp32).

Two ranks, DP=2 and TP=1, each holding SmolLM2 as the actor does (a Megatron ``GPTModel``),
each with ``cores // 2`` torch threads as a run sets them. The work is the demo's rollout batch
grown to ``--prompts`` arithmetic prompts x 8 samples (chat template, temperature 1):

* ``shared``: what a run does (``rollout.engine=megatron``, colocated): every rank follows rank
  0's call, each replica generates its share of the requests (whole GRPO groups), rank 0
  gathers them;
* ``alone``: rank 0's replica generates the whole call while the other waits
  (``bind_model(..., replicas_share=False)``), what every other engine does: one replica
  generates, the rest wait for the batch.

The two alternate, ``--repeats`` times after a warm-up of each; medians, their ratio, and how
many of the responses came out token for token the same (the two batch the rows differently,
so a row's logits may differ in the last bits and, rarely, flip a draw).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(ctx, model_dir: str, prompts: list[list[int]], new_tokens: int, repeats: int):
    import torch
    import torch.distributed as dist

    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.engines.base import SamplingParams
    from megarl.engines.megatron import MegatronEngine
    from megarl.models.hf_io import load_hf_config, load_hf_state_dict, load_hf_tokenizer
    from megarl.models.megatron_gpt import build_gpt_model, load_hf_weights
    from megarl.models.spec import spec_from_hf_config
    from megarl.trainer.engine_setup import megatron_engine_kwargs

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    enter_cpu_shims()
    parallel.join_launched_group(ctx, "cpu")
    parallel.init_model_parallel(1, 1)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    gpt = build_gpt_model(spec, 1, 1)
    load_hf_weights(gpt, spec, load_hf_state_dict(model_dir))
    kwargs = megatron_engine_kwargs(load_hf_tokenizer(model_dir), model_dir, spec, "cpu")
    engines = {"shared": MegatronEngine(**kwargs), "alone": MegatronEngine(**kwargs)}
    engines["shared"].bind_model([gpt])
    engines["alone"].bind_model([gpt], replicas_share=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=3)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, engine in engines.items():
            dist.barrier()
            if ctx.rank != 0:
                if name == "shared":
                    engine.serve()
                continue
            t0 = time.perf_counter()
            generations = engine.generate(prompts, params)
            if repeat:
                seconds[name].append(time.perf_counter() - t0)
            tokens[name] = [g.response_ids for g in generations]
            if name == "shared":
                engine.release_followers()
    parallel.destroy()
    return (seconds, tokens) if ctx.rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    from bench_engines import demo_prompts

    from megarl.distributed.launcher import launch
    from megarl.models.hf_io import load_hf_tokenizer, resolve_model_path

    model_dir = str(resolve_model_path(None))
    prompts = demo_prompts(load_hf_tokenizer(model_dir), args.prompts)
    results = launch(
        worker, 2, args=(model_dir, prompts, args.new_tokens, args.repeats), timeout_s=3600
    )
    seconds, tokens = results[0]
    same = sum(a == b for a, b in zip(tokens["shared"], tokens["alone"], strict=True))
    generated = sum(len(ids) for ids in tokens["shared"])
    print(
        f"DP=2, TP=1, SmolLM2 fp32, {len(prompts)} requests ({args.prompts} prompts x 8), up "
        f"to {args.new_tokens} new tokens, {os.cpu_count()} cores, {args.repeats} repeats"
    )
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"  {name:>6}: median {median:.2f} s (min {min(values):.2f}, max "
            f"{max(values):.2f}), {generated / median:.0f} response tokens/s"
        )
    ratio = statistics.median(seconds["alone"]) / statistics.median(seconds["shared"])
    print(f"  alone / shared: {ratio:.2f}x")
    print(f"  responses token for token the same: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()

"""What ``rollout.batch_invariant=true`` costs: the trainer's logprob forward and the Megatron
engine's decode, default paths against batch-invariant ones, side by side in one process.

Workload (SmolLM2-135M, fp32, TP=1, one process): the forward is ``compute_logprobs`` of
``--seqs`` sequences of ``--len`` tokens in one packed micro-batch; the decode is the Megatron
engine generating ``--new`` tokens for each of ``--seqs`` prompts of 32 tokens (temperature 1,
no EOS stop). Runs alternate default / invariant ``--repeats`` times; the best of each is
reported, with the ratio.

Run: ``PYTHONPATH=$PWD python benchmarks/bench_batch_invariant.py``
"""

from __future__ import annotations

import argparse
import time

import torch

from megarl.distributed.launcher import launch


def _worker(ctx, seqs: int, length: int, new: int, repeats: int) -> dict[str, list[float]]:
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.batch import RolloutBatch
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.engines.base import Request, SamplingParams
    from megarl.engines.megatron import MegatronEngine
    from megarl.models.hf_io import load_hf_config, load_hf_state_dict
    from megarl.models.spec import spec_from_hf_config

    enter_cpu_shims()
    parallel.join_launched_group(ctx, "cpu")
    parallel.init_model_parallel(1, 1)
    spec = spec_from_hf_config(load_hf_config(None))
    state = load_hf_state_dict(None)
    actor = MegatronActor(spec, ActorConfig(), "cpu", torch.float32, state, 0, trainable=False)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, spec.vocab_size, (seqs, length), generator=gen)
    batch = RolloutBatch(
        tokens=tuple(tokens),
        prompt_lens=(4,) * seqs,
        group_ids=torch.zeros(seqs),
        rewards=torch.zeros(seqs),
        advantages=torch.zeros(seqs),
        engine_logprobs=tuple(torch.zeros(length - 4) for _ in range(seqs)),
    )
    engines = {
        flag: MegatronEngine([spec.vocab_size + 1], 0, spec.vocab_size, batch_invariant=flag)
        for flag in (False, True)
    }
    for engine in engines.values():
        engine.bind_model(actor.chunks)
    prompts = [tuple(row[:32].tolist()) for row in tokens]
    requests = [Request(prompt, seed=i) for i, prompt in enumerate(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    timings: dict[str, list[float]] = {}
    for _ in range(repeats):
        for flag in (False, True):
            actor.batch_invariant = flag
            start = time.perf_counter()
            actor.compute_logprobs(batch, [list(range(seqs))], 1.0)
            timings.setdefault(f"forward {flag}", []).append(time.perf_counter() - start)
            start = time.perf_counter()
            out = engines[flag].generate_requests(requests, params)
            timings.setdefault(f"decode {flag}", []).append(time.perf_counter() - start)
            assert sum(len(g.response_ids) for g in out) == seqs * new
    parallel.destroy()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--len", type=int, default=96)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    timings = launch(_worker, 1, args=(args.seqs, args.len, args.new, args.repeats))[0]
    print(f"SmolLM2-135M fp32 TP=1, {torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'':28s}{'default':>12s}{'invariant':>12s}{'ratio':>8s}")
    for name, tokens in (("forward", args.seqs * args.len), ("decode", args.seqs * args.new)):
        plain, invariant = min(timings[f"{name} False"]), min(timings[f"{name} True"])
        print(
            f"{name + ' tokens/s':28s}{tokens / plain:12.0f}{tokens / invariant:12.0f}"
            f"{plain / invariant:8.2f}"
        )
        print(f"{name + ' seconds':28s}{plain:12.2f}{invariant:12.2f}")


if __name__ == "__main__":
    main()

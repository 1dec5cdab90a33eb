"""Forward + backward time of padded vs packed micro-batches on SmolLM2-135M-Instruct.

Run: ``python benchmarks/bench_packing.py [--seqs 16] [--repeats 2] [--device cpu]``.

One Megatron rank (TP=1). A GRPO-like batch of sequences with mixed lengths (log-uniform between
``--min-len`` and ``--max-len`` tokens, a third of each is prompt) is split by the planner's
first-fit-decreasing token budget into micro-batches; the same micro-batches run one training
step (forward, backward, optimizer) right-padded (``actor.pack_sequences=false``) and packed
(``true``). Times are the best of ``--repeats`` after one warm-up each; the table shows tokens
computed, wall seconds and process CPU seconds side by side, plus the max |logprob| difference
between the two layouts (they compute the same function). On a shared CPU machine wall time is
dominated by other processes; with ``--threads 1`` (the default) the process CPU time measures
the work itself and is the figure to compare.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def _batch(num: int, min_len: int, max_len: int, vocab: int, seed: int):
    from megarl.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    logs = torch.empty(num).uniform_(math.log(min_len), math.log(max_len), generator=gen)
    lens = [round(math.exp(v)) for v in logs.tolist()]
    prompts = [max(1, n // 3) for n in lens]
    tokens = tuple(torch.randint(10, vocab, (n,), generator=gen) for n in lens)
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=tuple(prompts),
        group_ids=torch.arange(num) // 4,
        rewards=torch.zeros(num),
        advantages=torch.randn(num, generator=gen),
        engine_logprobs=tuple(torch.zeros(n - p) for n, p in zip(lens, prompts, strict=True)),
    )


def _bench(ctx, args):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.actor.training_loss import LossSettings
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.distributed.execution import (
        ExecutionRequest,
        decide_execution,
        detect_environment,
    )
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.models.hf_io import load_hf_config, open_hf_tensors, resolve_model_path
    from megarl.models.spec import spec_from_hf_config
    from megarl.planner.micro_batches import plan_forward_micro_batches
    from megarl.planner.step_plan import OptimizerStepPlan

    plans = {
        packed: decide_execution(
            ExecutionRequest(device=args.device, pack_sequences=packed, model_dtype=args.dtype),
            detect_environment(),
        )
        for packed in (False, True)
    }
    if plans[True].cpu_shims:
        enter_cpu_shims()
        torch.set_num_threads(args.threads)
    parallel.join_launched_group(ctx, args.device)
    parallel.init_model_parallel(1, 1)
    model_dir = resolve_model_path(None)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    batch = _batch(args.seqs, args.min_len, args.max_len, spec.vocab_size, args.seed)
    groups = plan_forward_micro_batches(
        list(range(batch.num_seqs)), batch.seq_lens, args.micro_batch_tokens
    )
    work = OptimizerStepPlan.by_hand(groups, batch.seq_lens, sum(batch.response_lens))
    loss = LossSettings(
        temperature=1.0,
        clip_low=0.2,
        clip_high=0.2,
        agg="token-mean",
        kl_coef=0.0,
        kl_estimator="low_var_kl",
        entropy_coef=0.0,
    )
    dtype = getattr(torch, plans[True].params_dtype)
    rows = {}
    logprobs = {}
    for packed in (False, True):
        cfg = ActorConfig(lr=1e-7, pack_sequences=packed)
        actor = MegatronActor(
            spec,
            cfg,
            args.device,
            dtype,
            open_hf_tensors(model_dir),
            pad_id=0,
            execution=plans[packed],
        )
        logprobs[packed] = actor.compute_logprobs(batch, groups, temperature=1.0)
        walls, cpus = [], []
        for _ in range(args.repeats + 1):
            _sync(args.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            actor.train_step(batch, work, 0, None, None, loss)
            _sync(args.device)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu_start)
            print(
                f"  {'packed' if packed else 'padded'}: {walls[-1]:.2f} s wall, "
                f"{cpus[-1]:.2f} s cpu",
                file=sys.stderr,
                flush=True,
            )
        computed = sum(actor._micro_batch(batch, g).num_tokens for g in groups)
        rows[packed] = (computed, min(walls[1:]), min(cpus[1:]))
        del actor
    diff = max(
        (logprobs[False][i].float() - logprobs[True][i].float()).abs().max().item()
        for i in logprobs[False]
    )
    parallel.destroy()
    return {
        "rows": rows,
        "real_tokens": sum(batch.seq_lens),
        "num_mbs": len(groups),
        "lens": batch.seq_lens,
        "logprob_diff": diff,
        "plan": plans[True].summary(),
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()

    from megarl.distributed.launcher import launch

    [out] = launch(_bench, 1, args=(args,))
    lens = sorted(out["lens"])
    print(
        f"SmolLM2-135M-Instruct, {args.seqs} sequences, lengths {lens[0]}..{lens[-1]} "
        f"(median {lens[len(lens) // 2]}), {out['real_tokens']} real tokens, "
        f"{out['num_mbs']} micro-batches of <= {args.micro_batch_tokens} tokens"
    )
    print(f"execution: {out['plan']}")
    print("one training step (forward + backward + optimizer):")
    print(f"{'layout':<8} {'tokens computed':>16} {'wall s':>8} {'cpu s':>8}")
    (pad_tokens, pad_s, pad_cpu), (pack_tokens, pack_s, pack_cpu) = (
        out["rows"][False],
        out["rows"][True],
    )
    print(f"{'padded':<8} {pad_tokens:>16} {pad_s:>8.2f} {pad_cpu:>8.2f}")
    print(f"{'packed':<8} {pack_tokens:>16} {pack_s:>8.2f} {pack_cpu:>8.2f}")
    print(
        f"speed-up padded/packed: wall {pad_s / pack_s:.2f}x, cpu {pad_cpu / pack_cpu:.2f}x "
        f"(token ratio {pad_tokens / pack_tokens:.2f}x); max |logprob diff| "
        f"{out['logprob_diff']:.2e}"
    )


if __name__ == "__main__":
    main()

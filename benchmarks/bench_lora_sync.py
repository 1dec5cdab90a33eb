"""Adapter-only vs full weight sync from the Megatron actor to the transformers engine.

Run: ``python benchmarks/bench_lora_sync.py [--model PATH] [--rank 8] [--tp 1] [--repeats 3]``
(CPU; default model: the packaged SmolLM2-135M-Instruct, TP=1, one process per TP rank).

One run, same actor, same engine: the full sync gathers every base weight to rank 0 under HF
names and copies it into the engine (what a step costs without LoRA, or with LoRA after a sleep
that freed the engine's base weights); the adapter-only sync gathers the LoRA adapter under
peft's names and updates the engine's injected LoRA layers (what the base-weight gate sends while
the engine kept its base weights). Each is timed ``--repeats`` times after a warm-up; the best
time is the verdict (noise-robust on a shared machine). Target: adapter-only under 5%
of full sync on SmolLM2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from megarl.distributed.launcher import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # full_gather.py, the baseline

TARGET_RATIO = 0.05


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up (first adapter load injects the peft layers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _worker(ctx, model_dir: str, rank: int, tp: int, repeats: int):
    import torch.distributed as dist
    from full_gather import gather_hf_state_dict

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig, LoraConfig
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.engines.base import LoraAdapter
    from megarl.engines.hf import HFEngine
    from megarl.models.hf_io import load_hf_config, load_hf_model, open_hf_tensors
    from megarl.models.lora import hf_target_modules
    from megarl.models.spec import spec_from_hf_config

    enter_cpu_shims()
    parallel.join_launched_group(ctx, "cpu")
    parallel.init_model_parallel(tp, 1)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    cfg = ActorConfig(tp=tp, lora=LoraConfig(rank=rank, alpha=2.0 * rank))
    actor = MegatronActor(spec, cfg, "cpu", torch.float32, open_hf_tensors(model_dir), pad_id=0)
    engine = None
    if ctx.rank == 0:
        model, tokenizer = load_hf_model(model_dir)
        engine = HFEngine(model, tokenizer)
    targets = tuple(hf_target_modules(spec, cfg.lora.target_modules))

    def full_sync():
        state = gather_hf_state_dict(actor.local_params(), spec)
        if engine is not None:
            engine.update_weights(state.items())
        dist.barrier()

    def adapter_sync():
        adapter = actor.gather_lora_adapter()
        if engine is not None:
            assert adapter is not None, "rank 0 gathers the adapter"
            engine.load_lora_adapter(LoraAdapter(adapter, rank, cfg.lora.alpha, targets))
        dist.barrier()

    full_s = _best_of(full_sync, repeats)
    adapter_s = _best_of(adapter_sync, repeats)
    base_params = sum(p.numel() for _, _, p in actor.local_params())
    adapter_params = sum(t.numel() for t in (actor.gather_lora_adapter() or {}).values())
    parallel.destroy()
    return {
        "full_s": full_s,
        "adapter_s": adapter_s,
        "base_params": base_params,
        "adapter_params": adapter_params,
    }


def main() -> None:
    from megarl.models.hf_io import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: packaged SmolLM2)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = str(resolve_model_path(args.model))
    result = launch(_worker, args.tp, args=(model_dir, args.rank, args.tp, args.repeats))[0]
    ratio = result["adapter_s"] / result["full_s"]
    print(f"model {model_dir} | TP={args.tp} | LoRA rank {args.rank} on q,k,v,o,gate,up,down")
    print(
        f"full sync     : {result['full_s']:.3f} s  ({result['base_params'] / 1e6:.1f}M "
        f"params on rank 0's shard)"
    )
    print(
        f"adapter only  : {result['adapter_s']:.3f} s  ({result['adapter_params'] / 1e6:.2f}M "
        f"peft tensor elements)"
    )
    verdict = "PASS" if ratio < TARGET_RATIO else "FAIL"
    print(f"adapter / full: {ratio:.1%}  (target < {TARGET_RATIO:.0%}: {verdict})")


if __name__ == "__main__":
    main()

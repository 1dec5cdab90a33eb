"""Weight export of a mixture-of-experts model with its experts on one rank (EP=1) or split over
two (EP=2): what expert parallelism costs the streaming exporter.

Run: ``python benchmarks/bench_export_moe.py [--repeats 3] [--bucket-mb 64]`` (CPU/gloo, a few
minutes). A random-init Qwen3-MoE of 78.7M parameters (hidden 512, 4 layers, 8 experts of
intermediate 512, top-2; SmolLM2's 49152-token vocabulary), fp32, saved once under the megarl
cache. Both layouts run 2 worker processes (DP=2), one thread each: at EP=1 every rank holds all
experts and rank 0 exports everything itself; at EP=2 rank 1 holds experts 4-7 and sends them to
rank 0 point to point, bucket by bucket.

Printed per layout: median wall time of one export (barrier to barrier, slowest rank), HF bytes
delivered to rank 0, the part of them sent by the other rank, and the exporter's high-water mark
of held bytes on the worst rank (bound: one bucket plus one gathered tensor); then the EP=2 / EP=1
time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megarl.distributed.launcher import launch

MOE_HF_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 49152,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 512,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def model_folder() -> str:
    from megarl.models.hf_io import cache_dir
    from megarl.models.random_init import save_random_hf_model

    return str(save_random_hf_model(MOE_HF_CONFIG, 0, cache_dir() / "random-moe-79m"))


def _worker(ctx, folder: str, ep: int, bucket_mb: int, repeats: int) -> dict:
    import torch.distributed as dist

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.export.stream import open_stream
    from megarl.models.hf_io import load_hf_config, open_hf_tensors
    from megarl.models.spec import spec_from_hf_config

    enter_cpu_shims()
    torch.set_num_threads(1)
    parallel.join_launched_group(ctx, "cpu")
    parallel.init_model_parallel(1, 1, ep=ep)
    spec = spec_from_hf_config(load_hf_config(folder))
    weights = open_hf_tensors(folder)
    actor = MegatronActor(
        spec, ActorConfig(ep=ep), "cpu", torch.float32, weights, pad_id=0, trainable=False
    )

    def export_once() -> tuple[int, int, int]:
        stream = open_stream(actor.local_params(), spec, bucket_mb << 20)
        for bucket in stream.buckets():
            bucket.clear()  # an engine would copy the bucket in here, then drop it
        items = [item for bucket in stream.plan.buckets for item in bucket.items]
        from_peer = sum(i.nbytes for i in items if i.ep_rank not in (None, 0))
        return stream.num_bytes, stream.peak_bytes, from_peer

    export_once()  # warm-up
    times, peaks, nbytes, from_peer = [], [], 0, 0
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        nbytes, held, from_peer = export_once()
        dist.barrier()
        times.append(time.perf_counter() - start)
        peaks.append(held)
    parallel.destroy()
    return {
        "time": statistics.median(times),
        "bytes": nbytes,
        "held": max(peaks),
        "from_peer": from_peer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args()
    folder = model_folder()
    from megarl.models.hf_io import load_hf_state_dict

    params = sum(t.numel() for t in load_hf_state_dict(folder).values())
    print(
        f"random-init Qwen3-MoE ({params / 1e6:.1f}M parameters, 8 experts, top-2) fp32, "
        f"2 CPU/gloo processes (DP=2), {args.bucket_mb} MiB buckets, median of {args.repeats}"
    )
    print(f"{'layout':8} {'time':>10} {'to rank 0':>12} {'from rank 1':>12} {'held (own)':>12}")
    times = {}
    for ep in (1, 2):
        results = launch(_worker, 2, args=(folder, ep, args.bucket_mb, args.repeats), timeout_s=900)
        times[ep] = max(r["time"] for r in results)
        first = results[0]
        from_peer = first["from_peer"] if ep > 1 else 0
        print(
            f"EP={ep:<5} {times[ep] * 1e3:7.0f} ms {first['bytes'] / 2**20:8.1f} MiB "
            f"{from_peer / 2**20:8.1f} MiB {max(r['held'] for r in results) / 2**20:8.1f} MiB"
        )
    print(f"EP=2 / EP=1 export time: {times[2] / times[1]:.2f}")


if __name__ == "__main__":
    main()

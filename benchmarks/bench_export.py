"""Weight export of SmolLM2-135M: the streaming bucketed exporter vs the old full gather.

Run: ``python benchmarks/bench_export.py [--tp 3] [--pp 1] [--buckets 16,64,256] [--repeats 3]``
(CPU/gloo, a few minutes). SmolLM2 has 9 heads and 3 KV heads, so TP is 1 or 3.

For each method, fresh worker processes load the model, then export it ``--repeats`` times while
a sampler thread polls each rank's resident memory. Printed per method: median wall time of one
export (all ranks, barrier to barrier), throughput (HF bytes / time), the exporter's own
high-water mark of held bytes on the worst rank (streaming only: what ``export/peak_bytes``
reports), and the worst rank's RSS rise during export over its RSS before it (both methods;
noisy, but comparable). Rank 0 consumes the stream by dropping each bucket, as an engine does once
it has copied a bucket in; the old gather returns the whole state dict on rank 0.

With TP > 1, a raw ``torch.distributed.all_gather`` of every TP-sharded parameter inside each
TP group (the same bytes the exporter gathers) is timed too, as the communication floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from megarl.distributed.launcher import launch

PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Highest resident set size seen while active (polls /proc every few ms)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def _export_once(method: str, actor, spec, bucket_mb: int) -> tuple[int, int]:
    """One export; returns (HF bytes delivered to rank 0, exporter high-water mark)."""
    import torch.distributed as dist

    if method == "full_gather":
        from megarl.export.gather import gather_hf_state_dict

        state = gather_hf_state_dict(actor.local_params(), spec)
        nbytes = sum(t.numel() * t.element_size() for t in (state or {}).values())
        held = nbytes if dist.get_rank() == 0 else 0
        del state
        return nbytes, held
    if method == "raw_all_gather":
        return _raw_all_gather(actor), 0
    from megarl.export.stream import open_stream

    stream = open_stream(actor.local_params(), spec, bucket_mb << 20)
    for bucket in stream.buckets():
        bucket.clear()  # an engine would copy the bucket in here, then drop it
    return stream.num_bytes, stream.peak_bytes


def _raw_all_gather(actor) -> int:
    """All-gather every TP-sharded parameter in its TP group: the exporter's communication."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, group, total = ps.get_tensor_model_parallel_world_size(), None, 0
    group = ps.get_tensor_model_parallel_group()
    for rule, _layer, param in actor.local_params():
        if rule.layout == "replicated":
            continue
        buffers = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(buffers, param.detach().contiguous(), group=group)
        total += sum(b.numel() * b.element_size() for b in buffers)
        del buffers
    return total


def _worker(ctx, tp: int, pp: int, method: str, bucket_mb: int, repeats: int):
    import torch.distributed as dist

    from megarl.config.schema import ActorConfig
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.models.hf_io import load_hf_config, open_hf_tensors
    from megarl.models.spec import spec_from_hf_config
    from megarl.workers.megatron_actor import MegatronActor

    enter_cpu_shims()
    torch.set_num_threads(1)
    parallel.init_process_group("cpu", ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    parallel.init_model_parallel(tp, pp)
    spec = spec_from_hf_config(load_hf_config(None))
    actor = MegatronActor(spec, ActorConfig(tp=tp, pp=pp), "cpu", torch.float32,
                          open_hf_tensors(None), pad_id=0, trainable=False)
    _export_once(method, actor, spec, bucket_mb)  # warm-up
    times, peaks, rss_rises, nbytes = [], [], [], 0
    for _ in range(repeats):
        dist.barrier()
        before = RssSampler.rss()
        with RssSampler() as sampler:
            start = time.perf_counter()
            nbytes, held = _export_once(method, actor, spec, bucket_mb)
            dist.barrier()
            times.append(time.perf_counter() - start)
        peaks.append(held)
        rss_rises.append(max(0, sampler.peak - before))
    parallel.destroy()
    return {"time": statistics.median(times), "bytes": nbytes, "held": max(peaks),
            "rss_rise": max(rss_rises)}


def _row(label: str, results: list[dict]) -> str:
    t = max(r["time"] for r in results)
    nbytes = max(r["bytes"] for r in results)
    held = max(r["held"] for r in results)
    rss = max(r["rss_rise"] for r in results)
    return (f"{label:<22} {t * 1000:9.0f} ms {nbytes / t / 1e9:8.2f} GB/s "
            f"{held / 2**20:10.1f} MiB {rss / 2**20:10.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--buckets", default="16,64,256", help="bucket sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    world = args.tp * args.pp
    methods = [("full_gather", 0)] + [("stream", int(mb)) for mb in args.buckets.split(",")]
    if args.tp > 1:
        methods.append(("raw_all_gather", 0))
    print(f"SmolLM2-135M fp32, TP={args.tp} PP={args.pp} ({world} CPU/gloo processes), "
          f"median of {args.repeats} exports")
    print(f"{'method':<22} {'time':>12} {'throughput':>13} {'held (own)':>14} {'RSS rise':>14}")
    for method, bucket_mb in methods:
        results = launch(_worker, world, args=(args.tp, args.pp, method, bucket_mb, args.repeats),
                         timeout_s=900)
        label = f"stream {bucket_mb} MiB" if method == "stream" else method
        print(_row(label, results), flush=True)
    print("held (own): full_gather = the state dict rank 0 ends up holding; stream = the "
          "exporter's high-water mark on its worst rank (bound: one bucket + one gathered tensor)")


if __name__ == "__main__":
    main()

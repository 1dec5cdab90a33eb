"""Which CPU ops here give a row the same bits whatever else shares the call?

For each op, row ``i``'s result computed alone (or in a call of another size) is compared with
the same row's result inside a larger call, bitwise. ``max_abs`` is the largest difference
seen; 0.0 means invariant for the shapes tried. The findings drive
:mod:`megarl.models.batch_invariant` (and are recorded in ``benchmarks/RESULTS.md``).

Run: ``PYTHONPATH=$PWD python benchmarks/probe_batch_invariance.py``
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = (1, 2, 3, 5, 8, 16, 17, 31, 64, 100, 256, 1024)


def _worst(reference: torch.Tensor, candidates: list[torch.Tensor]) -> float:
    return max(float((reference - c).abs().max()) for c in candidates)


def _rows_op(name: str, op, width: int, long: int = 1024) -> None:
    """``op(x[:m])[0]`` for every ``m`` in ROWS against ``op(x)[0]`` over ``long`` rows."""
    torch.manual_seed(0)
    x = torch.randn(long, width)
    reference = op(x)[:1]
    diffs = {m: float((op(x[:m])[:1] - reference).abs().max()) for m in ROWS}
    bad = [m for m, d in diffs.items() if d != 0.0]
    print(f"{name:46s} max_abs={max(diffs.values()):.3e}  differs at rows={bad or '-'}")


def probe_linear() -> None:
    torch.manual_seed(0)
    for k, n in ((128, 128), (576, 1536), (1536, 576), (576, 49152)):
        w = torch.randn(n, k) / k**0.5
        _rows_op(f"F.linear K={k} N={n}, row 0", lambda x, w=w: F.linear(x, w), k, long=256)
        x = torch.randn(2048, k)
        full = F.linear(x, w)
        bad = [m for m in range(1, 130) if not torch.equal(F.linear(x[:m], w), full[:m])]
        print(f"{'  every row of M=1..129 vs M=2048: differs at':46s} M={bad or '-'}")
        # a fixed block of 64 rows: does a row's result depend on its slot in the block?
        x = torch.randn(64, k)
        row = torch.randn(k)
        outs = []
        for slot in range(64):
            block = x.clone()
            block[slot] = row
            outs.append(F.linear(block, w)[slot])
        print(
            f"{'  same row in each slot of a 64-row block':46s} max_abs={_worst(outs[0], outs):.3e}"
        )


def probe_reductions() -> None:
    x = torch.rand(8, 49152)
    alone = float((x[:1].sum(-1) - x.sum(-1)[:1]).abs().max())
    print(f"{'sum(dim=-1) over 49152 of rand, 1 row vs 8':46s} max_abs={alone:.3e}")
    _rows_op("sum(dim=-1) over 49152", lambda x: x.sum(-1, keepdim=True), 49152, long=64)
    _rows_op("log_softmax over 49152", lambda x: F.log_softmax(x, -1), 49152, long=64)
    _rows_op("softmax over 300", lambda x: F.softmax(x, -1), 300)
    norm = torch.nn.RMSNorm(576, eps=1e-5)
    with torch.no_grad():
        _rows_op("torch RMSNorm hidden 576", norm, 576)


def probe_elementwise_tails() -> None:
    """A vectorised kernel's scalar remainder: is element j the same bits whatever the length?"""
    torch.manual_seed(0)
    x = torch.randn(4099) * 3
    for name, fn in (("exp", torch.exp), ("sin", torch.sin), ("cos", torch.cos), ("silu", F.silu)):
        full = fn(x)
        worst = max(float((fn(x[:n]) - full[:n]).abs().max()) for n in range(1, 80))
        print(f"{name + ' of x[:n] vs of x, n=1..79':46s} max_abs={worst:.3e}")


def probe_attention() -> None:
    """Causal SDPA over a whole sequence vs one query at a time against a growing KV cache."""
    torch.manual_seed(0)
    heads, dim = 4, 32
    for seq in (16, 96, 300):
        q, k, v = (torch.randn(1, heads, seq, dim) for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        steps = [
            F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
            for t in range(seq)
        ]
        decode = torch.cat(steps, dim=2)
        print(
            f"{f'SDPA causal vs KV-cache decode, seq={seq}':46s} "
            f"max_abs={float((full - decode).abs().max()):.3e}"
        )


def probe_all_reduce() -> None:
    """gloo all-reduce of two ranks' partial sums: the same bits on both ranks and vs a + b?"""
    import os

    from torch.multiprocessing.spawn import spawn

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    spawn(_all_reduce_rank, nprocs=2, join=True)


def _all_reduce_rank(rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    parts = torch.randn(2, 4096, 576) * 100
    reduced = parts[rank].clone()
    dist.all_reduce(reduced)
    diffs = float((reduced - (parts[0] + parts[1])).abs().max())
    small = parts[rank][:1].clone()
    dist.all_reduce(small)
    row = float((small - reduced[:1]).abs().max())
    if rank == 0:
        print(f"{'gloo all_reduce(TP=2) vs a + b':46s} max_abs={diffs:.3e}")
        print(f"{'gloo all_reduce of 1 row vs of 4096 rows':46s} max_abs={row:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    probe_linear()
    probe_reductions()
    probe_elementwise_tails()
    probe_attention()
    probe_all_reduce()

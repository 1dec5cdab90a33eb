"""What this machine allows a GRPO step of SmolLM2-135M in fp32: the floors under generation and
the update, measured in one run.

Run: ``python benchmarks/bench_roofline.py [--rows 16] [--new-tokens 32] [--train-tokens 600]``
(CPU; torch only, no engine, no trainer).

Both engines and both trainers (megarl's and TRL's) spend their time in the same place: the
model's linear layers (the 7 per decoder layer and the tied output layer: every parameter but
the norms' 35 K; attention over <= 100 positions and the norms are a few percent). So the
matmuls of those shapes, timed here with torch's own kernels, bound what any engine or trainer
tuning can reach on this machine:

* **memory**: the read bandwidth (summing a 256 MiB tensor) and the floor it puts under one
  decode step, which must read every weight once (538 MB in fp32) whatever the batch;
* **a decode step's linears** at ``--rows`` sequences (the batch of a rollout: 4 prompts x 4
  samples in ``bench_peer_trl.py``): what the kernels reach, as GB/s of weights read; times
  ``--new-tokens`` steps it is the generation floor of a rollout that runs to its length limit;
* **training matmuls**: forward and both backward products of every linear layer at
  ``--train-tokens`` rows (the kept sequences of a step, packed): GFLOP/s and the seconds of
  the update's ``6 x parameters x tokens``.

Prints the floors and, for the workload of ``bench_peer_trl.py``, the shortest step they allow
megarl (generation + an update of ``--train-tokens``) against TRL (generation + an update of
every sequence, ``--trl-train-tokens``), so a target ratio can be checked against what the
machine can do before anyone tunes for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear layer of one forward of a Llama-style model, the output
    layer last."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    q = config["num_attention_heads"] * head_dim
    inter = config["intermediate_size"]
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)]
    layer += [(inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second a sum over 256 MiB reads."""
    data = torch.ones(64 << 20)
    return data.numel() * 4 / median_s(data.sum, repeats)


def decode_linears_s(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Seconds of one decode step's linear layers at ``rows`` sequences (one token each)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def step() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    return median_s(step, repeats)


def training_linears_s(weights: list[torch.Tensor], tokens: int, repeats: int) -> float:
    """Seconds of the forward and both backward products of every linear at ``tokens`` rows."""
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1]) for w in weights}
    grads = {w.shape[0]: torch.randn(tokens, w.shape[0]) for w in weights}

    def update() -> None:
        for w in weights:
            x, dy = inputs[w.shape[1]], grads[w.shape[0]]
            F.linear(x, w)
            dy @ w  # the input's gradient
            dy.t() @ x  # the weight's gradient

    return median_s(update, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="sequences decoded together")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps of a rollout")
    parser.add_argument("--train-tokens", type=int, default=600, help="tokens megarl trains")
    parser.add_argument("--trl-train-tokens", type=int, default=1200, help="tokens TRL trains")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from megarl.models.hf_io import resolve_model_path

    config = json.loads((Path(resolve_model_path(None)) / "config.json").read_text())
    weights = [torch.randn(out, inp) * 0.02 for out, inp in linear_shapes(config)]
    params = sum(w.numel() for w in weights)
    weight_bytes = params * 4
    print(
        f"SmolLM2-135M fp32: {len(weights)} linear layers, {params / 1e6:.1f} M parameters "
        f"({weight_bytes / 1e6:.0f} MB); {torch.get_num_threads()} torch threads"
    )
    bandwidth = read_bandwidth(args.repeats)
    read_floor = weight_bytes / bandwidth
    print(
        f"memory read: {bandwidth / 1e9:.1f} GB/s -> reading every weight once: "
        f"{1000 * read_floor:.1f} ms"
    )
    decode_s = {}
    for rows in sorted({args.rows, 2 * args.rows, 4 * args.rows}):
        step_s = decode_s[rows] = decode_linears_s(weights, rows, args.repeats)
        print(
            f"decode step's linears at {rows:>3} rows: {1000 * step_s:6.1f} ms "
            f"({weight_bytes / step_s / 1e9:4.1f} GB/s of weights, "
            f"{2 * params * rows / step_s / 1e9:4.0f} GFLOP/s; "
            f"{1000 * step_s / rows:.2f} ms per token)"
        )
    gen_s = args.new_tokens * decode_s[args.rows]  # the rollout's rows, timed above
    print(
        f"generation floor: {args.new_tokens} decode steps at {args.rows} rows: {gen_s:.2f} s "
        f"(the weights' read alone: {args.new_tokens * read_floor:.2f} s)"
    )
    update_s = {}
    for name, tokens in (("megarl", args.train_tokens), ("TRL", args.trl_train_tokens)):
        update_s[name] = training_linears_s(weights, tokens, args.repeats)
        print(
            f"update floor, {name} ({tokens} tokens): {update_s[name]:.2f} s "
            f"({6 * params * tokens / update_s[name] / 1e9:.0f} GFLOP/s)"
        )
    megarl, trl = gen_s + update_s["megarl"], gen_s + update_s["TRL"]
    print(
        f"step floor: megarl {megarl:.2f} s, TRL {trl:.2f} s; at these floors megarl/TRL "
        f"{megarl / trl:.2f}; against a TRL step of T seconds megarl's ratio cannot go below "
        f"{megarl:.2f}/T"
    )


if __name__ == "__main__":
    main()

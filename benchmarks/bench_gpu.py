"""GRPO on one GPU: per-phase times, tokens/s and ``perf/mfu/actor`` of the update phase.

Run on a CUDA machine (``pip install -e '.[gpu]'`` for transformer-engine; megatron-core is
required)::

    python benchmarks/bench_gpu.py                       # SmolLM2-135M, its shape and ~0.93B random
    python benchmarks/bench_gpu.py --models random-135m random-0.9b  # without the packaged model
    python benchmarks/bench_gpu.py --models smollm2 --steps 5 --pack both

Each model runs ``--steps`` GRPO steps through the real entry point (``megarl.train.run``,
``trainer.device=cuda``, bf16, the ``transformers`` rollout engine unless ``--engine vllm``);
the first step is a warm-up and the table reports the mean of the others. Zero-advantage
pruning is off: a random model earns no reward, and the update is what is timed. ``--pack both``
runs each model with ``actor.pack_sequences`` true and false. Without CUDA it exits with code 2
and one line saying so. Record the output and the command in ``benchmarks/RESULTS.md`` with the
device named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

# A Llama-style ~0.93B config (random weights; SmolLM2's tokenizer and vocabulary):
# 16 layers, hidden 2048, FFN 5632, 16 heads of 128 with 4 KV heads, untied embeddings.
ONE_B = {
    "model.hf_config.hidden_size": 2048,
    "model.hf_config.intermediate_size": 5632,
    "model.hf_config.num_hidden_layers": 16,
    "model.hf_config.num_attention_heads": 16,
    "model.hf_config.num_key_value_heads": 4,
    "model.hf_config.max_position_embeddings": 4096,
}
# SmolLM2-135M's shape with random weights: its compute where the packaged model cannot travel.
SMOLLM2_SHAPE = {
    "model.hf_config.hidden_size": 576,
    "model.hf_config.intermediate_size": 1536,
    "model.hf_config.num_hidden_layers": 30,
    "model.hf_config.num_attention_heads": 9,
    "model.hf_config.num_key_value_heads": 3,
    "model.hf_config.max_position_embeddings": 8192,
    "model.hf_config.tie_word_embeddings": "true",
}
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct", {}),
    "random-135m": ("random Llama, SmolLM2-135M's shape", {"model": "tiny_llama", **SMOLLM2_SHAPE}),
    "random-0.9b": ("random Llama ~0.93B", {"model": "tiny_llama", **ONE_B}),
}
PHASES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights", "step")


def _overrides(args, model_overrides: dict, packed: bool, run_dir: str) -> list[str]:
    base = {
        "trainer.device": "cuda",
        "trainer.total_steps": args.steps,
        "trainer.run_dir": run_dir,
        "trainer.log_console": "false",
        "trainer.tensorboard": "false",
        "rollout.engine": args.engine,
        "rollout.n": args.n,
        "data.prompts_per_step": args.prompts,
        "rollout.max_new_tokens": args.max_new_tokens,
        "actor.pack_sequences": str(packed).lower(),
        "actor.lr": 1e-6,
        "actor.micro_batch_tokens": args.micro_batch_tokens,
        "actor.logprob_micro_batch_tokens": 2 * args.micro_batch_tokens,
        "planner.old_log_prob": "always",
        "planner.prune_zero_adv": "off",  # a random model earns no reward: time the update anyway
    }
    base.update(model_overrides)
    return [f"{k}={v}" for k, v in base.items()]


def _mean(history: list[dict], key: str) -> float:
    values = [m[key] for m in history[1:] or history if m.get(key) is not None]
    return statistics.fmean(values) if values else float("nan")


def _report(label: str, history: list[dict]) -> None:
    phases = "  ".join(f"{p} {_mean(history, f'timing_s/{p}'):.2f}s" for p in PHASES)
    print(f"{label}\n  {phases}")
    print(
        f"  tokens/step {_mean(history, 'perf/total_num_tokens'):.0f} | perf/throughput "
        f"{_mean(history, 'perf/throughput'):.0f} tok/s | update: "
        f"{_mean(history, 'perf/actor_tokens_per_s'):.0f} tok/s, "
        f"{_mean(history, 'perf/actor_tflops'):.1f} TFLOP, perf/mfu/actor "
        f"{_mean(history, 'perf/mfu/actor'):.3f} ({history[-1].get('perf/mfu_note', '')})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--pack", default="on", choices=("on", "off", "both"))
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            "bench_gpu.py: error: needs a CUDA device (torch.cuda.is_available() is False); "
            "run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    from megarl.train import StartupError, run

    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__}")
    packs = {"on": [True], "off": [False], "both": [True, False]}[args.pack]
    for key in args.models:
        label, model_overrides = MODELS[key]
        for packed in packs:
            with tempfile.TemporaryDirectory(prefix="megarl-bench-gpu-") as run_dir:
                overrides = _overrides(args, model_overrides, packed, run_dir)
                try:
                    result = run(overrides)
                except StartupError as exc:
                    print(f"bench_gpu.py: error: {exc}", file=sys.stderr)
                    return 2
            _report(
                f"{label} | pack_sequences={packed} | {args.prompts}x{args.n} sequences, "
                f"<= {args.max_new_tokens} new tokens | "
                f"megarl-train {' '.join(overrides)}",
                result.history,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The transformers engine vs vLLM's CPU build, side by side in one run.

Run: ``python benchmarks/bench_engines.py [--repeats 5] [--full-runs] [--steps 20]``
(CPU; the packaged SmolLM2-135M-Instruct in fp32; vLLM must be installed: ``make install``).

Part 1, same process, alternating engines on the same work:

* generation: the demo's rollout batch (4 arithmetic prompts x 8 samples, chat template,
  12 new tokens, temperature 1) -> tokens/s;
* weight sync: the whole model's HF tensors (what the exporter streams each step), pushed
  into the engine -> seconds. vLLM runs twice: as a CPU run starts it (``vllm``: a sync copies
  into the live weights and packs the touched layers' kernels again) and with
  ``weight_load_method="reload"`` (``vllm-reload``: every layer rebuilt, CUDA's path and the
  CPU path before); their generations must be identical, bit for bit.

Each is repeated ``--repeats`` times after a warm-up, engines interleaved so both see the same
machine load; medians and the ratio are printed.

Part 2 (``--full-runs``): the embedded default run (``megarl-train``, SmolLM2, arithmetic) for
``--steps`` steps once with each engine, interleaved with nothing else: whole-run and start-up
seconds, generation seconds per response token, median step time, the phase split, the reward
curve and the largest ``rollout/logprob_abs_diff``; then the vllm / transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def demo_prompts(tokenizer, num_prompts: int = 4, group: int = 8) -> list[list[int]]:
    """The first step's prompts of the embedded default, each repeated ``group`` times."""
    from megarl.data.arithmetic import ArithmeticTask

    ids = []
    for problem in ArithmeticTask(seed=1234).problems(0, num_prompts):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return [p for p in ids for _ in range(group)]


def build_engines(model_dir: str):
    from megarl.engines.hf import HFEngine
    from megarl.engines.vllm import VLLMEngine
    from megarl.models.hf_io import load_hf_model, load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir)
    model, _ = load_hf_model(model_dir, device="cpu")
    settings = {
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": 1 << 30,
        "max_model_len": 1024,
    }
    t0 = time.perf_counter()
    vllm = VLLMEngine(model_dir, weight_load_method="load_weights", seed=0, **settings)
    start_s = time.perf_counter() - t0
    reload = VLLMEngine(model_dir, weight_load_method="reload", seed=0, **settings)
    engines = {"transformers": HFEngine(model, tokenizer), "vllm": vllm, "vllm-reload": reload}
    return tokenizer, engines, start_s


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_engines(model_dir: str, repeats: int) -> None:
    from safetensors.torch import load_file

    from megarl.engines.base import SamplingParams

    tokenizer, engines, vllm_start = build_engines(model_dir)
    prompts = demo_prompts(tokenizer)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    weights = [(k, v) for k, v in state.items() if k != "lm_head.weight"]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list] = {}
    gen_s: dict[str, list[float]] = {name: [] for name in engines}
    sync_s: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up
        engine.generate(prompts, params)
        engine.update_weights(weights)
    for _ in range(repeats):
        for name, engine in engines.items():
            out: list = []
            gen_s[name].append(timed(lambda e=engine, o=out: o.extend(e.generate(prompts, params))))
            tokens[name] = sum(len(g.response_ids) for g in out)
            outputs[name] = out
            sync_s[name].append(timed(lambda e=engine: e.update_weights(weights)))
    print(
        f"SmolLM2-135M-Instruct fp32, {len(prompts)} sequences x <= 12 new tokens, "
        f"{torch.get_num_threads()} torch threads, {repeats} interleaved repeats"
    )
    print(f"vLLM start-up (its engine-core process, eager): {vllm_start:.1f} s")
    print(f"{'engine':<14}{'gen s':>8}{'tokens/s':>10}{'sync s':>9}")
    med = {}
    for name in engines:
        med[name] = (statistics.median(gen_s[name]), statistics.median(sync_s[name]))
        print(
            f"{name:<14}{med[name][0]:>8.2f}{tokens[name] / med[name][0]:>10.1f}"
            f"{med[name][1]:>9.3f}"
        )
    print(
        f"vllm / transformers time: generation {med['vllm'][0] / med['transformers'][0]:.2f}x, "
        f"weight sync {med['vllm'][1] / med['transformers'][1]:.1f}x "
        f"({med['vllm'][1] - med['transformers'][1]:+.2f} s per step)"
    )
    print(
        f"vllm sync in place / reload: {med['vllm'][1] / med['vllm-reload'][1]:.2f}; "
        f"the same generations: {outputs['vllm'] == outputs['vllm-reload']}"
    )
    engines["vllm"].close()
    engines["vllm-reload"].close()


def full_run(engine: str, steps: int, run_dir: Path) -> tuple[float, list[dict]]:
    """The whole run's seconds (start-up included) and its metrics rows."""
    command = [
        sys.executable,
        "-m",
        "megarl.train",
        f"rollout.engine={engine}",
        f"trainer.total_steps={steps}",
        f"trainer.run_dir={run_dir}",
        "trainer.log_console=false",
        "trainer.tensorboard=false",
    ]
    t0 = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    whole_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return whole_s, rows


def gen_s_per_response_token(rows: list[dict]) -> float:
    """Generation seconds over all steps / response tokens sampled (the step's token count
    split by the mean prompt and response lengths)."""
    tokens = sum(
        r["perf/total_num_tokens"]
        * r["response_length/mean"]
        / (r["prompt_length/mean"] + r["response_length/mean"])
        for r in rows
    )
    return sum(r["timing_s/gen"] for r in rows) / tokens


def report_run(engine: str, whole_s: float, rows: list[dict]) -> None:
    steps = [r["timing_s/step"] for r in rows]
    phases = {p: statistics.median(r.get(f"timing_s/{p}", 0.0) for r in rows) for p in PHASES}
    diffs = [r["rollout/logprob_abs_diff"] for r in rows if r["rollout/logprob_abs_diff"]]
    rewards = " ".join(f"{r['critic/rewards/mean']:.2f}" for r in rows)
    print(
        f"  {engine}: whole run {whole_s:.0f} s | start-up {rows[0]['timing_s/startup/total']:.1f}"
        f" s | gen {1000 * gen_s_per_response_token(rows):.1f} ms per response token"
    )
    print(
        f"    median step {statistics.median(steps):.1f} s | "
        + " | ".join(f"{p} {s:.2f}" for p, s in phases.items())
        + f" | max lp_diff {max(diffs):.1e} over {len(diffs)} steps"
    )
    print(f"    reward per step: {rewards}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--full-runs", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from megarl.models.hf_io import resolve_model_path

    model_dir = str(resolve_model_path(None))
    bench_engines(model_dir, args.repeats)
    if args.full_runs:
        print(f"\nembedded default run, {args.steps} steps, each engine:")
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for engine in ("transformers", "vllm"):
                name = "hf" if engine == "transformers" else engine
                runs[engine] = full_run(name, args.steps, Path(tmp) / name)
                report_run(engine, *runs[engine])
        (hf_s, hf_rows), (vllm_s, vllm_rows) = runs["transformers"], runs["vllm"]
        print(
            f"vllm / transformers: whole run {vllm_s / hf_s:.2f}, generation per response "
            f"token {gen_s_per_response_token(vllm_rows) / gen_s_per_response_token(hf_rows):.2f}"
        )


if __name__ == "__main__":
    main()

"""The three rollout engines side by side in one run: transformers, vLLM's CPU build, and the
actor's own Megatron model (``rollout.engine=megatron``).

Run: ``python benchmarks/bench_engines.py [--repeats 5] [--full-runs] [--steps 20]
[--engines transformers,vllm,megatron,megatron-batch-invariant]``
(CPU; the packaged SmolLM2-135M-Instruct in fp32; vLLM must be installed: ``make install``).

Part 1, same process, alternating engines on the same work:

* start-up: what each engine costs beyond the trainer's own model (the transformers engine
  loads a second copy, vLLM starts its engine core; the Megatron engine is handed the actor's
  model: here a Megatron ``GPTModel`` built once in a world of one, outside the timing);
* generation: the demo's rollout batch (4 arithmetic prompts x 8 samples, chat template,
  12 new tokens, temperature 1) -> tokens/s, beside ``bench_roofline.py``'s decode floor (12
  steps of the model's linear layers at 32 rows; what any engine must spend; timed after each
  repeat's engines, so its ratio compares like with like on a loaded machine);
* weight sync: the whole model's HF tensors (what the exporter streams each step), pushed
  into the engine -> seconds (the Megatron engine has nothing to receive: 0). vLLM runs twice:
  as a CPU run starts it (``vllm``: a sync copies into the live weights and packs the touched
  layers' kernels again) and with ``weight_load_method="reload"`` (``vllm-reload``: every layer
  rebuilt, CUDA's path and the CPU path before); their generations must be identical, bit for
  bit. ``megatron-batch-invariant``: the Megatron engine on the same model with
  ``rollout.batch_invariant=true`` (its cost: every product in fixed row blocks).

Each is repeated ``--repeats`` times after a warm-up, engines interleaved so all see the same
machine load; medians and the ratios are printed. The Megatron engine's calls run inside the CPU
shims (``megarl.distributed.platform``), as in a run; the others outside them.

Part 2 (``--full-runs``): the embedded default run (``megarl-train``, SmolLM2, arithmetic) for
``--steps`` steps once with each engine, one after the other: whole-run and start-up seconds,
generation seconds per response token, median step time, the phase split, the reward curve, the
largest ``rollout/logprob_abs_diff`` and the run's peak resident memory (the largest process:
for vLLM that is one of its processes, not their sum); then the ratios to the transformers
engine.
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


def build_engines(model_dir: str, names: tuple[str, ...]):
    from megarl.engines.hf import HFEngine
    from megarl.models.hf_io import load_hf_model, load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir)
    start_s = {}
    t0 = time.perf_counter()
    model, _ = load_hf_model(model_dir, device="cpu")
    engines: dict = {"transformers": HFEngine(model, tokenizer)}
    start_s["transformers"] = time.perf_counter() - t0
    if "vllm" in names:
        from megarl.engines.vllm import VLLMEngine

        settings = {
            "dtype": "float32",
            "enforce_eager": True,
            "kv_cache_memory_bytes": 1 << 30,
            "max_model_len": 1024,
        }
        t0 = time.perf_counter()
        engines["vllm"] = VLLMEngine(
            model_dir, weight_load_method="load_weights", seed=0, **settings
        )
        start_s["vllm"] = time.perf_counter() - t0
        engines["vllm-reload"] = VLLMEngine(
            model_dir, weight_load_method="reload", seed=0, **settings
        )
    gpt = actor_model(model_dir)  # the trainer's model: built by the run, not by the engine
    t0 = time.perf_counter()
    engines["megatron"] = megatron_engine(gpt, tokenizer, model_dir)
    start_s["megatron"] = time.perf_counter() - t0
    if "megatron-batch-invariant" in names:  # the same model, rollout.batch_invariant=true
        engines["megatron-batch-invariant"] = megatron_engine(gpt, tokenizer, model_dir, True)
    return tokenizer, engines, start_s


def actor_model(model_dir: str):
    """SmolLM2 as the actor holds it: a Megatron ``GPTModel`` in a world of one (TP=1)."""
    from megarl.distributed import parallel
    from megarl.distributed.platform import cpu_shims
    from megarl.models.hf_io import load_hf_config, load_hf_state_dict
    from megarl.models.megatron_gpt import build_gpt_model, load_hf_weights
    from megarl.models.spec import spec_from_hf_config

    parallel.init_process_group("cpu", 0, 1, "127.0.0.1", 0)
    parallel.init_model_parallel(1, 1)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    with cpu_shims():
        gpt = build_gpt_model(spec, 1, 1)
        load_hf_weights(gpt, spec, load_hf_state_dict(model_dir))
    return gpt


class ShimmedEngine:
    """The Megatron engine's calls inside the CPU shims, as a run makes them."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, prompts, params):
        from megarl.distributed.platform import cpu_shims

        with cpu_shims():
            return self.engine.generate(prompts, params)

    def update_weights(self, weights) -> int:
        return 0  # nothing to send: it generates with the actor's own parameters


def megatron_engine(gpt, tokenizer, model_dir: str, batch_invariant: bool = False) -> ShimmedEngine:
    from megarl.engines.megatron import MegatronEngine
    from megarl.models.hf_io import load_hf_config
    from megarl.models.spec import spec_from_hf_config
    from megarl.trainer.engine_setup import megatron_engine_kwargs

    spec = spec_from_hf_config(load_hf_config(model_dir))
    kwargs = megatron_engine_kwargs(tokenizer, model_dir, spec, "cpu", batch_invariant)
    engine = MegatronEngine(**kwargs)
    engine.bind_model([gpt])
    return ShimmedEngine(engine)


def decode_floor(model_dir: str, rows: int, steps: int):
    """``bench_roofline.py``'s generation floor as a function that times it once: ``steps``
    decode steps of the model's linear layers at ``rows`` sequences, fp32 (the median of 3).
    Timed between the engines' repeats, so it sees the load they see."""
    from bench_roofline import decode_linears_s, linear_shapes

    from megarl.models.hf_io import load_hf_config

    config = load_hf_config(model_dir).to_dict()
    weights = [torch.randn(out, inp) for out, inp in linear_shapes(config)]
    return lambda: steps * decode_linears_s(weights, rows, 3)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_engines(model_dir: str, repeats: int, names: tuple[str, ...]) -> None:
    from safetensors.torch import load_file

    from megarl.engines.base import SamplingParams

    tokenizer, engines, start_s = build_engines(model_dir, names)
    prompts = demo_prompts(tokenizer)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    weights = [(k, v) for k, v in state.items() if k != "lm_head.weight"]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    tokens = dict.fromkeys(engines, 0)
    outputs: dict[str, list] = {}
    gen_s: dict[str, list[float]] = {name: [] for name in engines}
    sync_s: dict[str, list[float]] = {name: [] for name in engines}
    time_floor = decode_floor(model_dir, len(prompts), params.max_new_tokens)
    floors_s: list[float] = []
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
        floors_s.append(time_floor())
    floor_s = statistics.median(floors_s)
    print(
        f"SmolLM2-135M-Instruct fp32, {len(prompts)} sequences x <= 12 new tokens, "
        f"{torch.get_num_threads()} torch threads, {repeats} interleaved repeats"
    )
    print(
        "start-up beyond the trainer's model: "
        + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in start_s.items())
    )
    floor_rate = len(prompts) * params.max_new_tokens / floor_s
    print(f"decode floor (bench_roofline): {floor_s:.2f} s for 12 steps, {floor_rate:.1f} tokens/s")
    width = max(14, *(len(name) + 2 for name in engines))
    print(f"{'engine':<{width}}{'gen s':>8}{'tokens/s':>10}{'of floor':>10}{'sync s':>9}")
    med = {}
    for name in engines:
        med[name] = (statistics.median(gen_s[name]), statistics.median(sync_s[name]))
        rate = tokens[name] / med[name][0]
        print(
            f"{name:<{width}}{med[name][0]:>8.2f}{rate:>10.1f}{rate / floor_rate:>10.2f}"
            f"{med[name][1]:>9.3f}"
        )
    for name in [name for name in ("vllm", "megatron") if name in engines]:
        print(
            f"{name} / transformers time: generation "
            f"{med[name][0] / med['transformers'][0]:.2f}x, weight sync "
            f"{med[name][1] - med['transformers'][1]:+.3f} s per step"
        )
    if "megatron-batch-invariant" in engines:
        ratio = med["megatron-batch-invariant"][0] / med["megatron"][0]
        print(f"batch-invariant mode / megatron time: generation {ratio:.2f}x")
    same = [g.response_ids for g in outputs["megatron"]] == [
        g.response_ids for g in outputs["transformers"]
    ]
    print(f"megarl's two loops (transformers, megatron) sample the same tokens: {same}")
    if "vllm" in engines:
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
    # a child of its own, so ru_maxrss below is this run's largest process
    probe = [sys.executable, "-c", _PEAK_RSS_PROBE, *command]
    peak = subprocess.run(probe, check=True, stdout=subprocess.PIPE, text=True).stdout
    whole_s = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[0]["peak_rss_gb"] = int(peak.strip().splitlines()[-1]) / 2**20
    return whole_s, rows


_PEAK_RSS_PROBE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""
"""Runs the command given and prints the peak resident KiB of its largest process."""


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
        f" s | gen {1000 * gen_s_per_response_token(rows):.1f} ms per response token | "
        f"peak RSS {rows[0]['peak_rss_gb']:.2f} GB"
    )
    print(
        f"    median step {statistics.median(steps):.1f} s | "
        + " | ".join(f"{p} {s:.2f}" for p, s in phases.items())
        + f" | max lp_diff {max(diffs):.1e} over {len(diffs)} steps"
    )
    print(f"    reward per step: {rewards}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--full-runs", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--engines",
        default="transformers,vllm,megatron,megatron-batch-invariant",
        help="which engines beside transformers (always run): vllm, megatron, "
        "megatron-batch-invariant (the Megatron engine with rollout.batch_invariant=true)",
    )
    args = parser.parse_args()
    from megarl.models.hf_io import resolve_model_path

    model_dir = str(resolve_model_path(None))
    names = tuple(args.engines.split(","))
    bench_engines(model_dir, args.repeats, names)
    if args.full_runs:
        print(f"\nembedded default run, {args.steps} steps, each engine:")
        runs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for engine in ("transformers", *(n for n in ("vllm", "megatron") if n in names)):
                name = "hf" if engine == "transformers" else engine
                runs[engine] = full_run(name, args.steps, Path(tmp) / name)
                report_run(engine, *runs[engine])
        hf_s, hf_rows = runs["transformers"]
        for engine in [name for name in ("vllm", "megatron") if name in runs]:
            whole_s, rows = runs[engine]
            print(
                f"{engine} / transformers: whole run {whole_s / hf_s:.2f}, generation per "
                f"response token "
                f"{gen_s_per_response_token(rows) / gen_s_per_response_token(hf_rows):.2f}, "
                f"peak RSS {rows[0]['peak_rss_gb'] / hf_rows[0]['peak_rss_gb']:.2f}"
            )


if __name__ == "__main__":
    main()

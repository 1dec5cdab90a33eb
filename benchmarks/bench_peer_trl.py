"""megarl vs TRL's ``GRPOTrainer`` on the same GRPO workload on CPU: the ratio of median step times.

Run: ``python benchmarks/bench_peer_trl.py [--engine hf|vllm] [--steps 6] [--threads 2]``
(CPU; ``--engine vllm`` needs vLLM's CPU build: ``make install``).

The workload, the same on both sides: the packaged SmolLM2-135M-Instruct (the HF folder that
``resolve_model_path(None)`` gives) in fp32, the embedded arithmetic task's prompts (the ones
megarl's default run draws, step for step, rendered with the chat template), 4 prompts x 4
samples per step, at most 32 new tokens, temperature 1.0, learning rate 1e-5 (megarl's), no KL
term (megarl's ``actor.kl_coef=0``; TRL's ``beta=0``), one optimizer step per batch, the
per-token-mean loss (TRL's ``loss_type="dapo"``), a constant learning rate, no gradient
checkpointing (megarl's ``actor.recompute=none``; TRL turns it on by default), ``--threads``
torch threads. The reward is the one megarl's default run uses for the arithmetic task
(``data.reward=auto``): the TRL side imports that very function from megarl, so both score a
response alike. Sampling is seeded on each side but not shared, so the responses, and with them
the rewards and the lengths, differ.

megarl runs as ``python -m megarl.train`` with Hydra overrides; its step times are
``timing_s/step`` of the run folder's ``metrics.jsonl``, its phases the ``timing_s/<phase>``
beside it. TRL runs in a subprocess, in a virtualenv of its own (``--trl-venv``, created on first
use and reused): TRL must never enter megarl's environment, and a ``.pth`` file that adds
megarl's site-packages after the venv's own lets pip add only what is missing (trl) instead of a
second torch and transformers, so both sides run the same torch and transformers. TRL's step is
timed by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end`` (generation, reward,
forward, backward and the optimizer step); its ``gen+score`` phase is
``_generate_and_score_completions``, the rest is ``update``.

The two runs are sequential (on 2 cores they cannot share the machine); step 1 of each warms
up and is left out of the medians. A megarl step whose groups all scored alike has nothing to
train (a "ghost" step, no update): the zero-advantage share per step is printed beside the
times, as is TRL's ``frac_reward_zero_std``, which it still runs forward and backward for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path.home() / ".cache" / "megarl" / "bench-trl-venv"
TRL_VERSION = "1.16.0"
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


@dataclass(frozen=True)
class Workload:
    """What both sides run; each field is one command-line flag."""

    steps: int
    prompts_per_step: int
    samples: int
    max_new_tokens: int
    temperature: float
    lr: float
    threads: int
    seed: int
    engine: str


@dataclass
class SideResult:
    """One side's per-step times and what explains them."""

    step_s: list[float]
    wall_s: float
    phases: dict[str, list[float]] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    zero_adv: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median over steps 2..N: step 1 pays for warm-up (allocations, first kernels)."""
        return statistics.median(self.step_s[1:] or self.step_s)


# ----------------------------------------------------------------------------- megarl side


def megarl_overrides(work: Workload, run_dir: Path) -> list[str]:
    """The Hydra overrides of megarl's run; prompts are composed from the same list."""
    return [
        f"trainer.total_steps={work.steps}",
        f"trainer.seed={work.seed}",
        f"rollout.n={work.samples}",
        f"data.prompts_per_step={work.prompts_per_step}",
        f"rollout.max_new_tokens={work.max_new_tokens}",
        f"rollout.temperature={work.temperature}",
        f"rollout.engine={work.engine}",
        f"actor.lr={work.lr}",
        "actor.kl_coef=0.0",
        "actor.ppo_mini_batches=1",
        "actor.ppo_epochs=1",
        "model.dtype=float32",
        "trainer.logger=[console,jsonl]",  # no TensorBoard: TRL reports to nothing either
        "trainer.progress=false",
        f"trainer.run_dir={run_dir}",
    ]


def megarl_prompts(work: Workload, model_dir: str) -> dict:
    """The problems megarl's run draws, step by step, as chat messages, token ids and answers,
    with the reward ``data.reward=auto`` picks for them (``module:function``)."""
    from megarl.data.loader import PromptStream
    from megarl.models.hf_io import load_hf_tokenizer
    from megarl.train import compose_config
    from megarl.trainer.rollout import encode_prompt
    from megarl.trainer.rollout_host import prompt_source

    cfg = compose_config(megarl_overrides(work, Path("unused")))
    reward = cfg.data.reward_choice.fixed
    if reward is None:
        raise SystemExit("data.reward=auto picks no single reward for this dataset")
    tokenizer = load_hf_tokenizer(model_dir)
    stream = PromptStream(prompt_source(cfg), cfg.data.prompts_per_step, cfg.trainer.seed)
    system = cfg.data.system_prompt
    rows = [
        {
            "step": step,
            "messages": problem.chat_messages(system),
            "prompt_ids": encode_prompt(tokenizer, problem, system),
            "answer": problem.answer,
        }
        for step in range(work.steps)
        for problem in stream.next_batch()
    ]
    return {"reward": f"{reward.fn.__module__}:{reward.fn.__qualname__}", "rows": rows}


def run_megarl(work: Workload, run_dir: Path) -> SideResult:
    """``python -m megarl.train`` over the workload; times from its ``metrics.jsonl``."""
    log = run_dir.parent / "megarl.log"
    command = [sys.executable, "-m", "megarl.train", *megarl_overrides(work, run_dir)]
    wall = _timed_run("megarl", command, log, cwd=REPO)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    return SideResult(
        step_s=[r["timing_s/step"] for r in rows],
        wall_s=wall,
        phases={p: [r.get(f"timing_s/{p}", 0.0) for r in rows] for p in PHASES},
        rewards=[r.get("critic/rewards/mean", float("nan")) for r in rows],
        zero_adv=[r.get("critic/advantages/zero_adv_ratio", float("nan")) for r in rows],
        lengths=[r.get("response_length/mean", float("nan")) for r in rows],
        notes=[f"torch threads: {megarl_threads()} (os.cpu_count() // world size 1)"],
    )


def megarl_threads() -> int:
    """The torch threads megarl's one CPU rank sets (``rank_loop``: cores // world size)."""
    return max(1, os.cpu_count() or 1)


# ----------------------------------------------------------------------------- TRL side


def ensure_trl_venv(venv: Path) -> Path:
    """A virtualenv holding ``trl==TRL_VERSION`` beside megarl's packages; its python.

    Made ``--without-pip``: ``python -m pip`` there is megarl's pip, seen through the ``.pth``,
    installing into the new venv (``sys.prefix``); packages it finds in megarl's site-packages
    count as installed, so only trl itself (and whatever else is missing) is added, and nothing
    outside the venv is changed (pip never uninstalls outside the environment it runs in).
    """
    python = venv / "bin" / "python"
    if _trl_version(python) == TRL_VERSION:
        return python
    if not python.exists():
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    megarl_site = sysconfig.get_paths()["purelib"]
    pth = f"import site; site.addsitedir({megarl_site!r})\n"
    (Path(purelib) / "_megarl_site_packages.pth").write_text(pth)
    pip = [str(python), "-m", "pip", "install", "--quiet", f"trl=={TRL_VERSION}"]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip install trl=={TRL_VERSION} failed:\n{done.stdout}{done.stderr}")
    if _trl_version(python) != TRL_VERSION:
        raise SystemExit(f"{venv}: `import trl` does not give {TRL_VERSION} after installing it")
    return python


def _trl_version(python: Path) -> str | None:
    """trl's version as ``python`` imports it, or None where it cannot."""
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else None


def run_trl(python: Path, work: Workload, model_dir: str, prompts: Path, tmp: Path) -> SideResult:
    """TRL's ``GRPOTrainer`` on the same prompts in the venv's python; times from its JSON."""
    script = tmp / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    out = tmp / "trl_result.json"
    log = tmp / "trl.log"
    command = [
        str(python),
        str(script),
        f"--model={model_dir}",
        f"--prompts={prompts}",
        f"--out={out}",
        f"--output-dir={tmp / 'trl_out'}",
        f"--samples={work.samples}",
        f"--prompts-per-step={work.prompts_per_step}",
        f"--max-new-tokens={work.max_new_tokens}",
        f"--temperature={work.temperature}",
        f"--lr={work.lr}",
        f"--steps={work.steps}",
        f"--threads={work.threads}",
        f"--seed={work.seed}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(work.threads), "TOKENIZERS_PARALLELISM": "false"}
    wall = _timed_run("TRL", command, log, env=env)
    result = json.loads(out.read_text())
    return SideResult(
        step_s=result["step_s"],
        wall_s=wall,
        phases={"gen+score": result["gen_s"], "update": result["update_s"]},
        rewards=result["rewards"],
        zero_adv=result["frac_reward_zero_std"],
        lengths=result["lengths"],
        notes=result["notes"],
    )


TRL_SCRIPT = '''
"""TRL's GRPOTrainer on the prompts bench_peer_trl.py wrote; per-step times to a JSON file."""

import argparse
import importlib
import json
import time

import torch


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("--model", "--prompts", "--out", "--output-dir"):
        parser.add_argument(name, required=True)
    for name in ("--samples", "--prompts-per-step", "--max-new-tokens", "--steps", "--threads",
                 "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--temperature", type=float, required=True)
    parser.add_argument("--lr", type=float, required=True)
    return parser.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(open(args.prompts).read())
    rows = spec["rows"]
    module, _, name = spec["reward"].partition(":")
    score = getattr(importlib.import_module(module), name)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rendered = tokenizer.apply_chat_template(
        [r["messages"] for r in rows], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]
    same_ids = all(list(a) == r["prompt_ids"] for a, r in zip(rendered, rows))
    seen: list[list[int]] = []

    def correctness(completions, answer, index, **_):
        """megarl's reward of each response text (the last assistant message's content)."""
        seen.append(sorted(set(index)))
        return [score(c[-1]["content"], a) for c, a in zip(completions, answer)]

    data = Dataset.from_list(
        [{"prompt": r["messages"], "answer": r["answer"], "index": i} for i, r in enumerate(rows)]
    )
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=False, fp16=False, report_to="none",
        seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        per_device_train_batch_size=args.samples * args.prompts_per_step,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=args.samples, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        gradient_checkpointing=False, use_vllm=False, logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    gen_s: list[float] = []

    class TimedTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_s.append(time.perf_counter() - t0)
            return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    timer = StepTimer()
    trainer = TimedTrainer(
        model=model, reward_funcs=correctness, args=config, train_dataset=data,
        processing_class=tokenizer, callbacks=[timer],
    )
    trainer.train()
    per_step = args.prompts_per_step
    expected = [list(range(s * per_step, (s + 1) * per_step)) for s in range(args.steps)]
    notes = [
        f"torch threads: {torch.get_num_threads()}",
        "prompt token ids equal megarl's: " + ("yes" if same_ids else "NO"),
        "same prompts as megarl, step for step: " + ("yes" if seen == expected else f"NO {seen}"),
        f"reward: {spec['reward']} (imported from megarl)",
        "TRL's own step_time log: "
        + " ".join(f"{log.get('step_time', float('nan')):.2f}" for log in timer.logs),
    ]
    result = {
        "step_s": timer.step_s,
        "gen_s": gen_s,
        "update_s": [s - g for s, g in zip(timer.step_s, gen_s)],
        "rewards": [log["reward"] for log in timer.logs],
        "frac_reward_zero_std": [log.get("frac_reward_zero_std") for log in timer.logs],
        "lengths": [log.get("completions/mean_length") for log in timer.logs],
        "notes": notes,
    }
    open(args.out, "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
'''


# ----------------------------------------------------------------------------- report


def _timed_run(side: str, command: list[str], log: Path, **popen: Any) -> float:
    """Run one side's ``command`` with its output in ``log``; its wall-clock seconds, the same
    measurement for both sides. A failure stops the benchmark with the log's tail."""
    t0 = time.perf_counter()
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, **popen)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{side} failed (exit {done.returncode}):\n{_tail(log)}")
    return wall


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _fmt(values: list[float], spec: str = ".1f") -> str:
    return " ".join(format(v, spec) if v is not None else "-" for v in values)


def report_side(name: str, side: SideResult) -> None:
    """Median, the per-step list, the phase split and what each step had to train."""
    phases = " | ".join(
        f"{p} {statistics.median(v[1:] or v):.2f}" for p, v in side.phases.items() if any(v)
    )
    print(
        f"{name}: median step {side.median:.2f} s (steps 2..{len(side.step_s)}) | "
        f"whole run {side.wall_s:.0f} s (start-up included)"
    )
    print(f"  step s:     {_fmt(side.step_s, '.2f')}")
    print(f"  phases (median s): {phases}")
    print(f"  reward:     {_fmt(side.rewards, '.2f')}")
    print(f"  zero-adv:   {_fmt(side.zero_adv, '.2f')}  (share of groups whose samples tied)")
    print(f"  resp len:   {_fmt(side.lengths, '.1f')}")
    for note in side.notes:
        print(f"  {note}")


def versions() -> str:
    """torch and transformers (shared by both sides through the .pth) and trl."""
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, trl {TRL_VERSION}"


def megarl_has_trl() -> bool:
    """Whether megarl's own interpreter can import trl (it must not)."""
    done = subprocess.run([sys.executable, "-c", "import trl"], capture_output=True)
    return done.returncode == 0


def parse_args() -> tuple[Workload, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-5, help="megarl's actor.lr default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234, help="megarl's trainer.seed default")
    parser.add_argument("--trl-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--trl-first", action="store_true", help="run TRL before megarl")
    args = parser.parse_args()
    work = Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})
    return work, args


def main() -> None:
    work, args = parse_args()
    from megarl.models.hf_io import resolve_model_path

    load_start = os.getloadavg()
    t0 = time.perf_counter()
    python = ensure_trl_venv(args.trl_venv)
    venv_s = time.perf_counter() - t0
    if megarl_has_trl():
        raise SystemExit(f"{sys.executable} imports trl: it must stay out of megarl's venv")
    if megarl_threads() != work.threads:
        print(f"note: megarl sets {megarl_threads()} torch threads here, TRL {work.threads}")
    model_dir = str(resolve_model_path(None))
    print(f"{versions()} | model {model_dir} (fp32) | trl venv {args.trl_venv} ({venv_s:.0f} s)")
    print(
        f"workload: {work.steps} steps x {work.prompts_per_step} prompts x {work.samples} "
        f"samples, <= {work.max_new_tokens} new tokens, temperature {work.temperature}, "
        f"lr {work.lr}, megarl engine {work.engine}, {work.threads} threads"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)}")
    with tempfile.TemporaryDirectory(prefix="bench-peer-trl-") as name:
        tmp = Path(name)
        prompts = tmp / "prompts.json"
        prompts.write_text(json.dumps(megarl_prompts(work, model_dir)))
        sides = {
            "megarl": lambda: run_megarl(work, tmp / "megarl_run"),
            "TRL": lambda: run_trl(python, work, model_dir, prompts, tmp),
        }
        order = ["TRL", "megarl"] if args.trl_first else ["megarl", "TRL"]
        results = {name: sides[name]() for name in order}
    for name in ("megarl", "TRL"):
        report_side(name, results[name])
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"megarl/TRL median step: {results['megarl'].median / results['TRL'].median:.2f}")


if __name__ == "__main__":
    main()

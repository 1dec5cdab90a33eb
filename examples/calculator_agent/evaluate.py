#!/usr/bin/env python
"""Measure a model on the calculator agent's held-out questions, as the tool loop runs it.

    .venv/bin/python examples/calculator_agent/evaluate.py --label base
    .venv/bin/python examples/calculator_agent/evaluate.py --model runs/calculator_agent/sft --label sft
    .venv/bin/python examples/calculator_agent/evaluate.py --table runs/calculator_agent/results.json

Each question of ``data/rl_val.parquet`` is one greedy trajectory of the built-in tool loop with
the calculator (``examples/tools/calculator.yaml``, at most 3 model turns), on the ``hf``
engine. Reported per model: ``tool_call_rate``, the share of trajectories with at least one
well-formed call of the tool (it parses, names the tool, its arguments fit the schema; what the
expression says is the accuracy's business), and
``accuracy``, the share the dataset's reward scores 1 (the number after the last ``####`` is
the answer), with its standard error. ``--model`` is an HF folder, or a megarl run folder or
checkpoint (its newest checkpoint, converted next to it); none: SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = HERE.parent / "tools" / "calculator.yaml"
DATA = HERE / "data" / "rl_val.parquet"


def model_folder(path: str | None) -> str | None:
    """An HF folder for ``path``: itself, or a megarl checkpoint's (newest of a run folder)
    converted once into ``<path>/eval_model``."""
    if path is None:
        return None
    from megarl.checkpoint.convert import hf_folder_for_training
    from megarl.checkpoint.layout import MARKER, checkpoints_dir, latest_checkpoint

    folder = Path(path)
    checkpoint = folder if (folder / MARKER).is_file() else None
    if checkpoint is None and checkpoints_dir(folder).is_dir():
        newest = latest_checkpoint(folder)
        checkpoint = None if newest is None else Path(newest.path)
    if checkpoint is None:
        return path
    return str(hf_folder_for_training(checkpoint, folder / "eval_model"))


def evaluate(model: str | None, data: Path, max_new_tokens: int) -> dict[str, float]:
    from megarl.agent.driver import make_samples, run_agent_loops
    from megarl.agent.loop import AgentSettings, ToolAgentLoop
    from megarl.data.files import load_problem_files
    from megarl.data.rewards import choose_reward
    from megarl.engines.base import SamplingParams
    from megarl.engines.hf import HFEngine
    from megarl.models.hf_io import load_hf_model
    from megarl.trainer.agent_rollout import problem_row
    from megarl.trainer.rollout import mask_runs

    hf_model, tokenizer = load_hf_model(model_folder(model))
    engine = HFEngine(hf_model, tokenizer)
    settings = AgentSettings(loop="tool", tool_config_path=str(TOOLS), max_turns=3)
    loop = ToolAgentLoop(settings, tokenizer)
    problems = load_problem_files([str(data)])
    messages = [p.chat_messages(None) for p in problems]
    samples = make_samples(
        [loop.prompt_ids(m) for m in messages],
        [problem_row(p, m) for p, m in zip(problems, messages, strict=True)],
        seed=0,
        messages=messages,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    result = run_agent_loops(engine, loop, samples, params, tokenizer)
    reward = choose_reward("auto", "files")
    called = correct = 0
    schemas = {name: tool.tool_schema for name, tool in loop.tools.items()}
    for problem, traj in zip(problems, result.trajectories, strict=True):
        turns = [
            tokenizer.decode(ids, skip_special_tokens=True)
            for ids, trained in mask_runs(traj.response_ids, traj.response_mask)
            if trained
        ]
        called += any(loop.renderer.tool_format.parse(turn, schemas).calls for turn in turns)
        text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
        correct += reward.for_source(problem.data_source).fn(text, problem.answer) == 1.0
    n = len(problems)
    accuracy = correct / n
    return {
        "tool_call_rate": called / n,
        "accuracy": accuracy,
        "accuracy_stderr": math.sqrt(accuracy * (1 - accuracy) / n),
        "n": n,
    }


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [f"{'model':<6} {'tool_call_rate':>15} {'accuracy':>17} {'n':>4}"]
    for label, r in results.items():
        accuracy = f"{r['accuracy']:.3f} +- {r['accuracy_stderr']:.3f}"
        lines.append(f"{label:<6} {r['tool_call_rate']:>15.3f} {accuracy:>17} {r['n']:>4}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--label", default=None)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--out", default="runs/calculator_agent/results.json")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--table", default=None, help="print the table of a results.json")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    measured = evaluate(args.model, Path(args.data), args.max_new_tokens)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[args.label or (args.model or "base")] = measured
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table({args.label or "model": measured}), flush=True)


if __name__ == "__main__":
    main()

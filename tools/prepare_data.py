#!/usr/bin/env python
"""Turn a question/answer dataset into verl's row schema, written as parquet for data.train_files.

python tools/prepare_data.py grade_school_math/data/train.jsonl data/gsm8k/train.parquet \\
    --split train --limit 1000
python tools/prepare_data.py MATH/train.jsonl data/math/train.parquet --task math

Reads .jsonl, .json or .parquet rows, or a folder written by Hugging Face ``datasets``'
``save_to_disk`` (a downloaded hub dataset: ``load_dataset(...)["train"].save_to_disk(dir)``),
and writes one verl row per problem: ``data_source``, ``prompt`` (one user message: the
question and an instruction saying how to give the answer), ``ability``,
``reward_model.ground_truth`` and ``extra_info`` (split, index, the original question).
``--task`` picks the columns, the instruction and the answer, as verl's own preprocessing
scripts for these datasets do:

- ``gsm8k``: ``question``; the number after ``####`` of ``answer`` (a plain number works too).
- ``math``: ``problem``; the last ``\\boxed{}`` of ``solution``, kept as LaTeX (an ``answer``
  column, where the copy has one, is preferred: ``--answer-key answer``).

Bad input is one line naming ``file:row``, exit 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from megarl.data.errors import DatasetError
from megarl.data.files import load_problem_files
from megarl.data.rewards import choose_reward, extract_last_boxed


@dataclass(frozen=True)
class Task:
    """How one dataset family becomes verl rows."""

    question_key: str
    answer_key: str
    data_source: str
    """verl's name for the dataset: ``data.reward=auto`` picks the reward by it."""
    reward: str
    instruction: str


TASKS: dict[str, Task] = {
    "gsm8k": Task(
        "question",
        "answer",
        "openai/gsm8k",
        "gsm8k",
        'Solve it step by step, then give the final number after "####".',
    ),
    "math": Task(
        "problem",
        "solution",
        "DigitalLearningGmbH/MATH-lighteval",
        "math",
        "Let's think step by step and output the final answer within \\boxed{}.",
    ),
}


def verl_rows(
    source: Path, task: Task, split: str, limit: int, data_source: str | None = None
) -> list[dict]:
    """The rows of ``source`` in verl's schema (read and checked as data.train_files is)."""
    reward = choose_reward(task.reward, task="files")
    problems = load_problem_files(str(source), task.question_key, task.answer_key, reward=reward)
    if limit:
        problems = problems[:limit]
    rows = []
    for index, p in enumerate(problems):
        answer = p.answer
        if task.reward == "math" and "\\boxed" in answer:  # a whole solution: its boxed answer
            boxed = extract_last_boxed(answer)
            if not boxed:
                raise DatasetError(f"{p.source}: {task.answer_key} has no complete \\boxed{{}}")
            answer = boxed
        rows.append(
            {
                "data_source": data_source or task.data_source,
                "prompt": [{"role": "user", "content": f"{p.prompt} {task.instruction}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "question": p.prompt},
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("source", type=Path, help="a .jsonl/.json/.parquet file or dataset folder")
    parser.add_argument("output", type=Path, help="the .parquet file to write")
    parser.add_argument("--task", choices=sorted(TASKS), default="gsm8k")
    parser.add_argument("--question-key", help="the question column (default: the task's)")
    parser.add_argument("--answer-key", help="the answer column (default: the task's)")
    parser.add_argument("--data-source", help="data_source to write (default: the task's)")
    parser.add_argument("--split", default="train")
    parser.add_argument("--limit", type=int, default=0, help="first N rows only (0 = all)")
    args = parser.parse_args(argv)
    if args.output.suffix != ".parquet":
        print(
            f"prepare_data: error: {args.output}: the output must be a .parquet file",
            file=sys.stderr,
        )
        return 2
    preset = TASKS[args.task]
    task = replace(
        preset,
        question_key=args.question_key or preset.question_key,
        answer_key=args.answer_key or preset.answer_key,
    )
    try:
        rows = verl_rows(args.source, task, args.split, args.limit, args.data_source)
    except DatasetError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.output.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

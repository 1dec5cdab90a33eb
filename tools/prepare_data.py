#!/usr/bin/env python
"""Turn a question/answer dataset into verl's row schema, written as parquet for data.train_files.

python tools/prepare_data.py grade_school_math/data/train.jsonl data/gsm8k/train.parquet \\
    --split train --limit 1000

Reads .jsonl, .json or .parquet rows with a question column and a GSM8K-style answer column
("... #### 72"; a plain number works too) and writes one verl row per problem:
``data_source``, ``prompt`` (one user message: the question and an instruction saying how to
give the answer), ``ability``, ``reward_model.ground_truth`` (the final number) and
``extra_info`` (split, index, the original question and answer). Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.data.errors import DatasetError
from megarl.data.files import load_problem_files

INSTRUCTION = 'Solve it step by step, then give the final number after "####".'


def verl_rows(
    source: Path, question_key: str, answer_key: str, data_source: str, split: str, limit: int
) -> list[dict]:
    """The rows of ``source`` in verl's schema (the reading and checks of data.train_files)."""
    problems = load_problem_files(str(source), question_key, answer_key)
    if limit:
        problems = problems[:limit]
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"{p.prompt} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": index, "question": p.prompt},
        }
        for index, p in enumerate(problems)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("source", type=Path, help="a .jsonl, .json or .parquet file")
    parser.add_argument("output", type=Path, help="the .parquet file to write")
    parser.add_argument("--question-key", default="question")
    parser.add_argument("--answer-key", default="answer")
    parser.add_argument("--data-source", default="openai/gsm8k")
    parser.add_argument("--split", default="train")
    parser.add_argument("--limit", type=int, default=0, help="first N rows only (0 = all)")
    args = parser.parse_args(argv)
    if args.output.suffix != ".parquet":
        print(
            f"prepare_data: error: {args.output}: the output must be a .parquet file",
            file=sys.stderr,
        )
        return 2
    try:
        rows = verl_rows(
            args.source,
            args.question_key,
            args.answer_key,
            args.data_source,
            args.split,
            args.limit,
        )
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

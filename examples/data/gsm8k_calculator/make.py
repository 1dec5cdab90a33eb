#!/usr/bin/env python
"""Write the GSM8K sample (``examples/data/gsm8k``) in verl's multi-turn row schema.

    .venv/bin/python examples/data/gsm8k_calculator/make.py

Each row keeps its question, ground truth and ``data_source`` (``openai/gsm8k``: the reward is
the number after the last ``####``), and gains what verl's tool-agent datasets carry:
``agent_name: tool_agent`` (the row runs under the built-in tool loop whatever
``rollout.agent.loop`` says) and ``extra_info.tools_kwargs`` (per tool, what its ``create``
receives: here the ground truth, which a checking tool could read; the calculator ignores it).
The instruction asks for the calculator by name.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "gsm8k"
INSTRUCTION = (
    "Solve it step by step. Use the calculator tool for the arithmetic. "
    'Then give the final number after "####".'
)


def multi_turn_row(row: dict) -> dict:
    question = row["extra_info"]["question"]
    answer = row["reward_model"]["ground_truth"]
    return {
        **row,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "agent_name": "tool_agent",
        "extra_info": {
            **row["extra_info"],
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": answer}}},
        },
    }


def main() -> None:
    for split in ("train", "test"):
        rows = [multi_turn_row(r) for r in pq.read_table(SOURCE / f"{split}.parquet").to_pylist()]
        pq.write_table(pa.Table.from_pylist(rows), HERE / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {HERE / f'{split}.parquet'}")


if __name__ == "__main__":
    main()

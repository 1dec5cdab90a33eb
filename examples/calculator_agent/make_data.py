#!/usr/bin/env python
"""Write the calculator agent's data: SFT traces that call the tool, and RL questions of a kind
the traces never show.

    .venv/bin/python examples/calculator_agent/make_data.py

* ``data/sft_train.jsonl``, ``data/sft_val.jsonl``: verl's SFT rows (``messages`` + ``tools``):
  a one-operation question on 2-3 digit numbers (``What is 347 * 28?``), the assistant's call
  of the calculator, the tool's answer, the final answer after ``####``. Multi-digit arithmetic
  a 135M model cannot do in its head, so the tool is the way to the answer.
* ``data/rl_train.parquet``, ``data/rl_val.parquet``: verl's RL rows (``prompt``,
  ``reward_model.ground_truth``, ``data_source: openai/gsm8k``: the reward reads the number
  after the last ``####``): the same arithmetic worded as problems the traces never show
  (``A shop sells 347 apples a day. How many apples does it sell in 28 days?``). The model must
  turn the wording into the calculator's expression, which SFT did not teach: RL has
  something to improve.

The tool schema is the one of ``examples/tools/calculator.yaml`` (what the tool loop describes
to the model), so SFT and RL show the model the same system message. Deterministic (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TOOLS = HERE.parents[0] / "tools" / "calculator.yaml"
INSTRUCTION = 'Use the calculator, then give the final number after "####".'
SFT_TRAIN, SFT_VAL, RL_TRAIN, RL_VAL = 320, 48, 256, 64
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def tool_schema() -> dict:
    return yaml.safe_load(TOOLS.read_text())["tools"][0]["tool_schema"]


def one_operation(rng: random.Random) -> tuple[str, int]:
    op = rng.choice(list(OPS))
    a = rng.randint(100, 999)
    b = rng.randint(10, 99) if op == "*" else rng.randint(100, 999)
    return f"{a} {op} {b}", OPS[op](a, b)


def sft_row(rng: random.Random, tools: list[dict]) -> dict:
    expression, value = one_operation(rng)
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return {
        "messages": [
            {"role": "user", "content": f"What is {expression}? {INSTRUCTION}"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(value)},
            {"role": "assistant", "content": f"{expression} = {value}. #### {value}"},
        ],
        "tools": tools,
    }


WORDINGS = (
    ("A shop sells {a} apples a day. How many apples does it sell in {b} days? ", "*"),
    ("Each of {b} boxes holds {a} pencils. How many pencils are there in all? ", "*"),
    ("Tom had {a} stamps and was given {b} more. How many stamps does he have now? ", "+"),
    ("{a} people are at a concert and {b} more arrive. How many people are there? ", "+"),
    ("A tank holds {a} liters and {b} liters leak out. How many liters are left? ", "-"),
    ("A library had {a} books and lent out {b}. How many books are still there? ", "-"),
)


def rl_row(rng: random.Random, split: str, index: int) -> dict:
    wording, op = rng.choice(WORDINGS)
    a = rng.randint(100, 999)
    b = rng.randint(10, 99) if op == "*" else rng.randint(100, a if op == "-" else 999)
    question = wording.format(a=a, b=b) + INSTRUCTION
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(OPS[op](a, b))},
        "extra_info": {"split": split, "index": index},
    }


def main() -> None:
    DATA.mkdir(exist_ok=True)
    tools = [tool_schema()]
    rng = random.Random(0)
    for name, count in (("sft_train", SFT_TRAIN), ("sft_val", SFT_VAL)):
        rows = [sft_row(rng, tools) for _ in range(count)]
        (DATA / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, count in (("rl_train", RL_TRAIN), ("rl_val", RL_VAL)):
        rows = [rl_row(rng, name, i) for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), DATA / f"{name}.parquet")
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()

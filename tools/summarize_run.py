#!/usr/bin/env python
"""Print the summary of a run from its metrics.jsonl: reward first vs last steps, time by phase.

python tools/summarize_run.py runs/default
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megarl.trainer.metrics import run_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a megarl run directory (holds metrics.jsonl)")
    parser.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    args = parser.parse_args(argv)
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"summarize_run: error: {path}: no such file", file=sys.stderr)
        return 2
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            print(f"summarize_run: error: {path}:{number}: not JSON ({exc.msg})", file=sys.stderr)
            return 2
    print(run_summary(rows, window=args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())

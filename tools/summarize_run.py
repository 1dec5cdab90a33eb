#!/usr/bin/env python
"""Summarize a run from its metrics.jsonl: scores, time per phase, what the planner and gates saved.

python tools/summarize_run.py runs/default                      # the summary tables
python tools/summarize_run.py runs/default --plot               # also runs/default/summary.png
python tools/summarize_run.py --compare runs/a runs/b           # side by side, compare_a_b.png
python tools/summarize_run.py --compare runs/a runs/b --out ab.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.data.errors import DatasetError
from megarl.data.files import read_rows as read_dataset_rows
from megarl.trainer.summary import compare, summarize
from megarl.trainer.summary_plot import MATPLOTLIB_MISSING, SUMMARY_PLOT, plot_runs

PROG = "summarize_run"


class BadRun(Exception):
    """A run directory that cannot be read: the message is the whole error line."""


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``, read as a JSONL dataset is (blank lines
    skipped); BadRun names the file (and line) that is wrong."""
    if not run_dir.is_dir():
        raise BadRun(f"{run_dir}: no such directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise BadRun(f"{path}: no such file")
    try:
        return [row for _, row in read_dataset_rows(str(path))]
    except DatasetError as exc:
        raise BadRun(str(exc)) from None


def run_names(run_dirs: list[Path]) -> list[str]:
    """Folder names as labels; with the parent folder too where two runs share a name."""
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", type=Path, nargs="?", help="a megarl run directory (holds metrics.jsonl)"
    )
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help="two runs side by side"
    )
    parser.add_argument("--plot", action="store_true", help="write the run's curves as a PNG")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the PNG (default: RUN_DIR/{SUMMARY_PLOT}; with --compare compare_<A>_<B>.png here)",
    )
    parser.add_argument("--window", type=int, default=3, help="steps in the reward's mean")
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (args.compare is None):
        return _error("give either RUN_DIR or --compare RUN_A RUN_B")
    if args.window < 1:
        return _error(f"--window={args.window}: must be at least 1")
    try:
        if args.compare is not None:
            return _compare(args.compare, args.out, args.window)
        return _summarize(args.run_dir, args.plot, args.out, args.window)
    except BadRun as bad:
        return _error(str(bad))


def _summarize(run_dir: Path, plot: bool, out: Path | None, window: int) -> int:
    rows = read_rows(run_dir)
    print(summarize(rows, window=window).text())
    if not plot:
        return 0
    return _plot({run_names([run_dir])[0]: rows}, out or run_dir / SUMMARY_PLOT)


def _compare(run_dirs: list[Path], out: Path | None, window: int) -> int:
    names = run_names(run_dirs)
    runs = {name: read_rows(d) for name, d in zip(names, run_dirs, strict=True)}
    summaries = {name: summarize(rows, window=window) for name, rows in runs.items()}
    print("\n\n".join(table.text() for table in compare(summaries)))
    default = Path("compare_" + "_".join(n.replace("/", "-") for n in names) + ".png")
    return _plot(runs, out or default)


def _plot(runs: dict[str, list[dict]], out: Path) -> int:
    try:
        plot_runs(runs, out)
    except ImportError:
        return _error(MATPLOTLIB_MISSING, code=1)
    except OSError as exc:
        return _error(f"{out}: cannot write ({exc.strerror or exc})")
    print(f"\nwrote {out}")
    return 0


def _error(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

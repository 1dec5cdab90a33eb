"""Per-call cost of the code sandbox: calls/s of a trivial program, two versions side by side.

Each version is the ``megarl`` package of a git ref (default ``main``: the sandbox before the
change under test) or of this checkout, run in its own interpreter so the two never share a
module. Measurements alternate (before, after, before, ...) so that the machine's load falls on
both; each prints calls/s of ``print(1)`` run one after another and ``--concurrency`` at once,
the CPU time per call of every process a call starts (launcher, init, program), and the layers
the version's report lists.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_sandbox.py [--before main] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import asyncio, json, resource, sys, time
from megarl.agent.sandbox import SandboxLimits, probe, run_python

calls, concurrency = int(sys.argv[1]), int(sys.argv[2])
limits = SandboxLimits(timeout_s=30)

async def main():
    report = await probe()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    for _ in range(calls):
        assert (await run_python("print(1)", limits)).stdout == "1\\n"
    sequential = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    for _ in range(calls // concurrency):
        await asyncio.gather(*(run_python("print(1)", limits) for _ in range(concurrency)))
    concurrent = time.perf_counter() - start
    cpu = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / calls
    print(json.dumps({
        "sequential": calls / sequential,
        "concurrent": (calls // concurrency * concurrency) / concurrent,
        "cpu_ms": 1000 * cpu,
        "layers": len(report.applied),
        "applied": report.applied,
    }))

asyncio.run(main())
"""


def export(ref: str, into: Path) -> Path:
    """The ``megarl`` package of ``ref``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "megarl"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(tree: Path, calls: int, concurrency: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(calls), str(concurrency)],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        cwd=tree,  # ``-c`` puts the working folder first on sys.path
    ).stdout
    return json.loads((out or "").strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="calls/s of a trivial program in the sandbox")
    parser.add_argument("--before", default="main", help="git ref of the version to compare to")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as tmp:
        trees = {"before": export(args.before, Path(tmp)), "after": ROOT}
        results: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(measure(tree, args.calls, args.concurrency))
    print(
        f"print(1) in the sandbox, {args.calls} calls per measurement, {args.rounds} rounds "
        f"alternated (median); before = {args.before}, after = this checkout"
    )
    print(
        f"{'version':8} {'layers':>6} {'calls/s':>8} {f'x{args.concurrency} calls/s':>14} {'cpu ms/call':>12}"
    )
    medians = {}
    for name, runs in results.items():
        medians[name] = {
            key: statistics.median(run[key] for run in runs)
            for key in ("sequential", "concurrent", "cpu_ms")
        }
        m = medians[name]
        print(
            f"{name:8} {runs[0]['layers']:>6} {m['sequential']:>8.2f} {m['concurrent']:>14.2f} "
            f"{m['cpu_ms']:>12.1f}"
        )
    b, a = medians["before"], medians["after"]
    print(
        f"after/before: calls/s {a['sequential'] / b['sequential']:.2f}x, "
        f"x{args.concurrency} calls/s {a['concurrent'] / b['concurrent']:.2f}x, "
        f"cpu/call {a['cpu_ms'] / b['cpu_ms']:.2f}x"
    )
    added = sorted(set(results["after"][0]["applied"]) - set(results["before"][0]["applied"]))
    print(f"layers added: {', '.join(added) or 'none'}")


if __name__ == "__main__":
    main()

"""Wait until a Ray cluster has N live nodes; fail fast, naming the node, if it does not.

Called by slurm/megarl.sbatch after starting each node's ``ray start`` step. Exits 0 once the
cluster has ``--nodes`` live nodes; exits 3 with one line naming the Slurm node when the timeout
passes or its ``srun`` step (``--step-pid``) has already exited, with the tail of its log.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

POLL_S = 0.3


def _step_alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _log_tail(path: str | None, lines: int = 5) -> str:
    if not path or not Path(path).exists():
        return ""
    tail = Path(path).read_text(errors="replace").strip().splitlines()[-lines:]
    return ("; log " + path + ": " + " | ".join(tail)) if tail else ""


def _fail(args: argparse.Namespace, why: str) -> int:
    print(
        f"megarl.sbatch: error: Slurm node {args.node} {why}{_log_tail(args.log)}",
        file=sys.stderr,
        flush=True,
    )
    return 3


def _live_nodes(address: str, deadline: float, args: argparse.Namespace):
    """Connect to the head (retrying until it answers), then yield the live-node count."""
    import ray

    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError):
            if time.monotonic() > deadline or not _step_alive(args.step_pid):
                yield None
                return
            time.sleep(POLL_S)
    try:
        while True:
            yield sum(1 for node in ray.nodes() if node.get("Alive"))
    finally:
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--node", default="?", help="Slurm node being awaited (for messages)")
    parser.add_argument("--step-pid", type=int, default=None)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    start = time.monotonic()
    deadline = start + args.timeout
    for live in _live_nodes(args.address, deadline, args):
        if live is not None and live >= args.nodes:
            print(
                f"megarl.sbatch: {args.node} joined ({live} Ray node(s), "
                f"{time.monotonic() - start:.1f} s)",
                flush=True,
            )
            return 0
        if not _step_alive(args.step_pid):
            return _fail(args, "stopped before joining the Ray cluster (its ray start exited)")
        if time.monotonic() > deadline:
            return _fail(
                args,
                f"did not join the Ray cluster at {args.address} within "
                f"{args.timeout:.0f} s (live nodes: {live or 0} of {args.nodes})",
            )
        time.sleep(POLL_S)
    return _fail(
        args, f"did not join: no Ray head answered at {args.address} within {args.timeout:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())

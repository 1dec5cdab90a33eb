"""Test-only fault injection: make one rank die abruptly at a given step.

``MEGARL_FAULT_INJECT=<rank>:<step>`` makes that rank call ``os._exit(137)`` (what a SIGKILL or the
OOM killer looks like from outside) at the start of that step, after writing the wall-clock time
to ``MEGARL_FAULT_INJECT_MARK`` if set, so tests can measure how fast the failure is reported.
Unset (always, outside tests) it costs one dictionary lookup per step.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "MEGARL_FAULT_INJECT"
MARK_ENV = "MEGARL_FAULT_INJECT_MARK"
EXIT_CODE = 137


def parse(spec: str) -> tuple[int, int]:
    """``"1:2"`` -> (rank 1, step 2)."""
    rank, _, step = spec.partition(":")
    return int(rank), int(step)


def maybe_die(rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec or parse(spec) != (rank, step):
        return
    mark = os.environ.get(MARK_ENV)
    if mark:
        with open(mark, "w") as handle:
            handle.write(f"{time.time():.3f}\n")
    print(f"fault injection: rank {rank} exits with {EXIT_CODE} at step {step}", file=sys.stderr,
          flush=True)
    os._exit(EXIT_CODE)

"""Test-only fault injection: make one rank, or the split rollout actor, die abruptly at a step;
or make one rank's main loop freeze, or raise.

``MEGARL_FAULT_INJECT=<rank>:<step>`` makes that rank call ``os._exit(137)`` (what a SIGKILL or the
OOM killer looks like from outside) at the start of that step; ``rollout:<step>`` does the same to
the rollout actor of a split placement when it starts that step's rollout. Before dying it writes
the wall-clock time to ``MEGARL_FAULT_INJECT_MARK`` if set, so tests can measure how fast the
failure is reported. ``MEGARL_FAULT_FREEZE=<rank>:<step>`` makes that rank's main loop sleep
forever at the start of that step (after marking the step's first phase), as a deadlock or a
stuck device would: the process and its heartbeat thread live on, only the loop stops.
``MEGARL_FAULT_RAISE=<rank>:<step>`` makes that rank's main loop raise :class:`InjectedError` at
the same point, as a bug in the training code would. ``rollout:<step>`` in either of the first two
names the asynchronous rollout loop (split placement) when it draws that step's prompts. Unset (always, outside tests) each costs one
dictionary lookup per step.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "MEGARL_FAULT_INJECT"
FREEZE_ENV = "MEGARL_FAULT_FREEZE"
RAISE_ENV = "MEGARL_FAULT_RAISE"
MARK_ENV = "MEGARL_FAULT_INJECT_MARK"
EXIT_CODE = 137
ROLLOUT = "rollout"


def parse(spec: str) -> tuple[int | str, int]:
    """``"1:2"`` -> (rank 1, step 2); ``"rollout:2"`` -> ("rollout", step 2)."""
    who, _, step = spec.partition(":")
    return (who if who == ROLLOUT else int(who)), int(step)


def maybe_die(who: int | str, step: int) -> None:
    """``who`` is a rank, or :data:`ROLLOUT` for the split rollout actor."""
    spec = os.environ.get(ENV)
    if not spec or parse(spec) != (who, step):
        return
    _write_mark()
    name = who if who == ROLLOUT else f"rank {who}"
    print(
        f"fault injection: {name} exits with {EXIT_CODE} at step {step}",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_CODE)


def maybe_freeze(who: int | str, step: int) -> None:
    """Sleep forever if ``MEGARL_FAULT_FREEZE`` names this rank (or :data:`ROLLOUT`: the
    asynchronous rollout loop, when it draws that step's prompts) and step."""
    spec = os.environ.get(FREEZE_ENV)
    if not spec or parse(spec) != (who, step):
        return
    _write_mark()
    name = who if who == ROLLOUT else f"rank {who}"
    print(f"fault injection: {name} freezes at step {step}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


class InjectedError(RuntimeError):
    """What ``MEGARL_FAULT_RAISE`` raises: an unexpected error (not a one-line MegarlError)."""


def maybe_raise(rank: int, step: int) -> None:
    """Raise :class:`InjectedError` if ``MEGARL_FAULT_RAISE`` names this rank and step."""
    spec = os.environ.get(RAISE_ENV)
    if spec and parse(spec) == (rank, step):
        raise InjectedError(f"fault injection: rank {rank} raises at step {step}")


def _write_mark() -> None:
    mark = os.environ.get(MARK_ENV)
    if mark:
        with open(mark, "w") as handle:
            handle.write(f"{time.time():.3f}\n")

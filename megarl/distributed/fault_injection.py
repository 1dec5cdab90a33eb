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
names the asynchronous rollout loop (split placement) when it draws that step's prompts.

``MEGARL_FAULT_AT=<rank>:<step>:<phase>:<action>`` acts the first time that rank's main loop
enters ``phase`` (a heartbeat phase: ``rollout``, ``scatter``, ``update_actor``,
``update_weights``, ``record_metrics``, ``save``, ...) of that step, so a test can hit any
phase: ``die`` (exit 137 as above), ``freeze`` (sleep forever as above), ``kill-engine``
(SIGKILL the rank's vLLM engine-core processes, as the out-of-memory killer would, and go on) or
``corrupt-engine`` (in phase ``rollout``: scale one weight tensor, :data:`CORRUPT_TENSOR`, by
:data:`CORRUPT_FACTOR` inside the rank's rollout engine just before that step's generation, as
a sync that wrote wrong bits would; the logprob guard must stop the run at that step).
Unset (always, outside tests) each costs one dictionary lookup per step or phase.
"""

from __future__ import annotations

import os
import sys
import time

from megarl.distributed.processes import command_line, descendants, kill_all

ENV = "MEGARL_FAULT_INJECT"
FREEZE_ENV = "MEGARL_FAULT_FREEZE"
RAISE_ENV = "MEGARL_FAULT_RAISE"
AT_ENV = "MEGARL_FAULT_AT"
MARK_ENV = "MEGARL_FAULT_INJECT_MARK"
EXIT_CODE = 137
ROLLOUT = "rollout"
CORRUPT_TENSOR = "model.norm.weight"
"""The tensor ``corrupt-engine`` scales: the final norm (one tensor in every Llama-family model,
never fused or repacked by an engine), which moves every logit."""
CORRUPT_FACTOR = 1.5

_engine: object | None = None
"""The rollout engine of this process (registered by the rollout host), for ``corrupt-engine``."""


def register_engine(engine: object | None) -> None:
    """The rollout host's engine (None: forget it), the target of ``corrupt-engine``."""
    global _engine
    _engine = engine


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


_fired_at = False


def at_phase(rank: int, step: int, phase: str) -> None:
    """Act as ``MEGARL_FAULT_AT`` says if it names this rank, step and phase (once per process)."""
    global _fired_at
    spec = os.environ.get(AT_ENV)
    if not spec or _fired_at:
        return
    who, at_step, at, action = spec.split(":")
    if (int(who), int(at_step), at) != (rank, step, phase):
        return
    _fired_at = True
    _write_mark()
    print(
        f"fault injection: rank {rank} {action} in {phase} of step {step}",
        file=sys.stderr,
        flush=True,
    )
    if action == "die":
        os._exit(EXIT_CODE)
    if action == "freeze":
        while True:
            time.sleep(3600)
    if action == "kill-engine":
        _kill_engine_cores()
        return
    if action == "corrupt-engine":
        if _engine is None:
            raise RuntimeError(f"fault injection: rank {rank} has no rollout engine to corrupt")
        _engine.scale_weight(CORRUPT_TENSOR, CORRUPT_FACTOR)  # type: ignore[attr-defined]
        return
    raise ValueError(
        f"{AT_ENV}={spec}: the action must be die, freeze, kill-engine or corrupt-engine"
    )


def _kill_engine_cores() -> None:
    """SIGKILL this process's vLLM engine-core children (vLLM titles them ``VLLM::EngineCore``)."""
    cores = [pid for pid in descendants(os.getpid()) if "EngineCore" in command_line(pid)]
    if not cores:
        raise RuntimeError("fault injection: kill-engine found no vLLM engine-core process")
    kill_all(cores)


def _write_mark() -> None:
    mark = os.environ.get(MARK_ENV)
    if mark:
        with open(mark, "w") as handle:
            handle.write(f"{time.time():.3f}\n")

"""The live progress display (``trainer.progress``): which phase the step is in, how far that
phase got, and when the run should end.

A CPU step takes ~30 s and a GPU step minutes, so one line per step leaves the console silent
while a step runs. With progress on, rank 0's console shows above the step lines a bar of steps
done, the current phase with its work done of its total (``update_actor 2/4 optimizer steps``)
and an ETA for the run. Only rank 0 reports: it holds the rollout host and is training rank 0,
so it sees generation, its logprob passes, its optimizer steps and the weight sync.

The model is pure: :class:`PhaseProgress` (one report), :func:`describe`, :func:`run_eta_s` and
:func:`progress_enabled` take plain data and are tested on it. :class:`LiveProgress` is the thin rich sink the
console owns; the rank loop reports through one :class:`PhaseHook` and never sees rich. With
progress off the hook is :func:`no_progress`, which prints nothing and costs one call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from rich.console import Console as RichConsole
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

ETA_WINDOW = 5
"""Steps the ETA averages: recent ones, as the first includes warm-up (allocation, compiling)."""


@dataclass(frozen=True)
class PhaseProgress:
    """One report: the step is in ``phase`` (verl's ``timing_s/`` names: ``gen``,
    ``old_log_prob``, ``ref``, ``values``, ``update_critic``, ``update_actor``,
    ``update_weights``, ``validate``) and has done ``done`` of ``total`` ``unit``."""

    phase: str
    done: int
    total: int | None = None
    """None where the total is not known in advance."""
    unit: str = ""
    """What ``done`` counts: sequences, optimizer steps, buckets, prompts."""


class PhaseHook(Protocol):
    """What the rank loop and the rollout producer call as work is done (rank 0 only)."""

    def __call__(self, phase: str, done: int, total: int | None = None, unit: str = "") -> None: ...


def no_progress(phase: str, done: int, total: int | None = None, unit: str = "") -> None:
    """The hook with progress off, and on every rank but 0: does nothing."""


@contextlib.contextmanager
def reported(hook: PhaseHook, phase: str, total: int, unit: str) -> Iterator[None]:
    """Report ``phase`` at 0 of ``total`` before the block and at ``total`` after it: for work
    done in one call that cannot count its parts (a logprob pass over its sequences)."""
    hook(phase, 0, total, unit)
    yield
    hook(phase, total, total, unit)


def describe(report: PhaseProgress) -> str:
    """The phase as the bar shows it: ``update_actor 2/4 optimizer steps``."""
    if report.total is None:
        counted = f" {report.done}" if report.done else ""
    else:
        counted = f" {report.done}/{report.total}"
    unit = f" {report.unit}" if counted and report.unit else ""
    return f"{report.phase}{counted}{unit}"


def run_eta_s(
    step_seconds: Sequence[float], steps_left: int, elapsed_s: float, window: int = ETA_WINDOW
) -> float | None:
    """Seconds until the run ends: the mean of the last ``window`` step times for each of the
    ``steps_left`` steps not finished (the current one included), less what the current step
    has already run (``elapsed_s``), but never less than the steps after it. None before a
    step has finished: there is nothing to estimate from."""
    if not step_seconds:
        return None
    if steps_left <= 0:
        return 0.0
    recent = step_seconds[-window:]
    mean = sum(recent) / len(recent)
    return mean * (steps_left - 1) + max(0.0, mean - elapsed_s)


def format_eta(seconds: float | None) -> str:
    """``ETA 1:02:03``; ``ETA -:--:--`` while unknown."""
    if seconds is None:
        return "ETA -:--:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"ETA {hours}:{minutes:02d}:{secs:02d}"


def progress_enabled(setting: bool | str, console_on: bool, isatty: bool) -> bool:
    """``trainer.progress`` resolved: never without the console logger; ``auto`` only on a
    terminal, so CI logs and sbatch files keep their one line per step."""
    if not console_on or setting is False:
        return False
    return setting is True or isatty


class LiveProgress:
    """The rich bar of steps with the current phase and the run's ETA, drawn by ``console``
    (the console logger's, so its step lines print above the bar)."""

    def __init__(
        self,
        console: RichConsole,
        total_steps: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock = clock
        self._total_steps = total_steps
        self._steps_done = 0
        self._step_seconds: list[float] = []
        self._step_started: float | None = None
        self._progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("{task.description}"),
            _EtaColumn(self),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("", total=total_steps)

    def start(self) -> None:
        self._progress.start()

    def stop(self) -> None:
        self._progress.stop()

    def phase(self, phase: str, done: int, total: int | None = None, unit: str = "") -> None:
        """A :class:`PhaseHook`: the first report after a step ended starts the next step.
        Redraws at once: reports come per phase or optimizer step, far below the refresh rate."""
        if self._step_started is None:
            self._step_started = self._clock()
        description = describe(PhaseProgress(phase, done, total, unit))
        self._progress.update(self._task, description=description, refresh=True)

    def step_done(self, seconds: float) -> None:
        """A step ended after ``seconds`` (its ``timing_s/step``)."""
        self._step_seconds.append(seconds)
        self._steps_done += 1
        self._step_started = None
        self._progress.update(self._task, advance=1, description="")

    def skip(self, steps: int) -> None:
        """Steps a resumed run had done already (no times: they do not count for the ETA)."""
        self._steps_done += steps
        self._progress.advance(self._task, steps)

    def eta(self) -> str:
        """``ETA h:mm:ss`` now (:func:`run_eta_s` on the times of the steps run so far)."""
        started = self._step_started
        elapsed = 0.0 if started is None else self._clock() - started
        steps_left = self._total_steps - self._steps_done
        return format_eta(run_eta_s(self._step_seconds, steps_left, elapsed))


class _EtaColumn(ProgressColumn):
    """The run's ETA, asked of the sink at every refresh, so it counts down within a step that
    reports nothing for minutes (a long generation)."""

    def __init__(self, sink: LiveProgress):
        super().__init__()
        self._sink = sink

    def render(self, task: Task) -> Text:
        return Text(self._sink.eta(), style="progress.remaining")

"""Where step metrics go: ``metrics.jsonl`` (flushed every step), TensorBoard, Weights & Biases
and the console (``trainer.logger``, verl's key and names).

Metric names follow verl's where one exists (``timing_s/update_actor``, ``critic/rewards/mean``,
``actor/pg_loss``) so runs can be compared across frameworks.

wandb is imported only when ``wandb`` is among the loggers, and its run starts at the first step
written, so a resumed run can first be told the run id its checkpoint saved
(:meth:`MetricsWriter.continue_wandb_run`): the resumed run continues the same wandb run
(``resume="allow"``), a fresh start gets a new id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import string
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")

WANDB_MISSING_MESSAGE = (
    "trainer.logger names wandb, which is not installed: pip install wandb "
    "(or leave wandb out of trainer.logger)"
)


def new_wandb_run_id() -> str:
    """A fresh wandb run id: 8 characters of ``[a-z0-9]``, as wandb makes its own."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


@dataclass(frozen=True)
class WandbRun:
    """Which wandb run the metrics go to, and what it records about the run."""

    project: str
    """``trainer.project_name``."""
    name: str
    """``trainer.experiment_name`` (the run's display name)."""
    run_id: str
    """New for a fresh start; the checkpoint's for a resumed run."""
    config: Mapping[str, Any]
    """The resolved run configuration, logged as the wandb run's config."""
    directory: Path
    """Where wandb keeps its files (``<directory>/wandb/``) unless ``WANDB_DIR`` says otherwise."""


class _WandbSink:
    """One wandb step per training step: ``log(scalars, step=step)``."""

    def __init__(self, run: WandbRun):
        self.run = run
        self._active = None

    def continue_run(self, run_id: str) -> None:
        if self._active is not None:
            raise RuntimeError("the wandb run already started; a saved run id came too late")
        self.run = dataclasses.replace(self.run, run_id=run_id)

    def start(self):
        """The wandb run, started on first use."""
        if self._active is None:
            self._active = self._init()
        return self._active

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.start().log(dict(scalars), step=step)

    def _init(self):
        import wandb

        directory = None if os.environ.get("WANDB_DIR") else str(self.run.directory)
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=self.run.project,
            name=self.run.name,
            id=self.run.run_id,
            resume="allow",
            config=dict(self.run.config),
            dir=directory,
            # megarl prints its own console; wandb must not wrap stdout/stderr
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def close(self) -> None:
        """Finish the run and stop wandb's service process, which is when its files are
        complete: a spawned rank ends with ``os._exit``, so wandb's own exit hook never runs."""
        if self._active is not None:
            import wandb

            self._active.finish()
            self._active = None
            wandb.teardown()


class MetricsWriter:
    """Append one JSON object per step to ``<run_dir>/metrics.jsonl``; mirror scalars to
    TensorBoard and wandb. Each sink is optional (``trainer.logger``).

    The TensorBoard writer opens at the first step written, with ``purge_step`` = that step: after a
    resume from step k (``metrics.jsonl`` already cut back to k), events of steps > k left by the
    interrupted run are hidden, so curves show each step once. Nothing is deleted.

    A kill in the middle of a write leaves a last line without its newline; appending to it would
    glue the next record onto the torn one, so the writer first cuts that fragment off (it holds no
    complete record) and says so on stderr.
    """

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        jsonl: bool = True,
        wandb: WandbRun | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = self._open_jsonl() if jsonl else None
        self._tensorboard = tensorboard
        self._tb = None
        self._wandb = _WandbSink(wandb) if wandb is not None else None

    def _open_jsonl(self):
        path = self.run_dir / "metrics.jsonl"
        torn = cut_torn_tail(path)
        if torn:
            print(
                f"megarl-train: warning: {path}: dropped a torn last line ({torn} bytes without "
                "a newline, from a write cut short)",
                file=sys.stderr,
                flush=True,
            )
        return open(path, "a", encoding="utf-8")

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run this writer logs to (None without wandb): saved with a checkpoint."""
        return self._wandb.run.run_id if self._wandb is not None else None

    def continue_wandb_run(self, run_id: str) -> None:
        """Log to the wandb run ``run_id`` (a resumed run's checkpoint saved it); before the first
        write only. Ignored without wandb."""
        if self._wandb is not None:
            self._wandb.continue_run(run_id)

    def start(self) -> None:
        """Start the wandb run now (else at the first write): a resumed run calls this once it
        has passed the saved run id, so a wandb that cannot start stops the run before step 1."""
        if self._wandb is not None:
            self._wandb.start()

    def write(self, metrics: Mapping[str, Any]) -> None:
        if self._jsonl is not None:
            record = {k: _jsonable(v) for k, v in metrics.items()}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        step = int(metrics["step"])
        scalars = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
        }
        tb = self._tensorboard_from(step)
        if tb is not None:
            for key, value in scalars.items():
                tb.add_scalar(key, value, step)
            tb.flush()
        if self._wandb is not None:
            self._wandb.write(step, scalars)

    def _tensorboard_from(self, first_step: int):
        if self._tb is None and self._tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional at run time
                self._tensorboard = False
                return None
            self._tb = SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"), purge_step=first_step
            )
        return self._tb

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline; returns the bytes cut (0: none, or no file).

    Every record is written as one line ending in ``\\n``, so bytes after the last newline are a
    record whose write never finished.
    """
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as handle:
        start = max(0, size - 65536)
        while True:
            handle.seek(start)
            chunk = handle.read(size - start)
            last = chunk.rfind(b"\n")
            if last >= 0 or start == 0:
                break
            start = max(0, start - 65536)
        keep = start + last + 1 if last >= 0 else 0
        if keep == size:
            return 0
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())
    return size - keep


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def step_line(m: Mapping[str, Any]) -> str:
    """One readable console line per step."""
    if "sft/loss" in m:
        return _sft_step_line(m)
    parts = [
        f"step {m['step']:>3}",
        f"reward {m['critic/rewards/mean']:.3f}",
        f"zero-adv {m['critic/advantages/zero_adv_ratio']:.0%}",
        f"pg_loss {m['actor/pg_loss']:+.4f}",
        f"entropy {m['actor/entropy']:.3f}",
        f"len {m['response_length/mean']:.1f}",
        f"lp_diff {m['rollout/logprob_abs_diff']:.1e}",
        f"{m['timing_s/step']:.1f}s",
    ]
    scores = _validation_scores(m)
    return _with_detail_lines(" | ".join(parts), m, f"validation: {scores}" if scores else None)


def _sft_step_line(m: Mapping[str, Any]) -> str:
    """The line of a supervised fine-tuning step: its loss, perplexity, tokens trained."""
    parts = [
        f"step {m['step']:>3}",
        f"loss {m['sft/loss']:.4f}",
        f"ppl {m['sft/ppl']:.2f}",
        f"tokens {m['sft/trained_tokens']:,.0f}",
        f"grad_norm {m['actor/grad_norm']:.3f}",
        f"{m['timing_s/step']:.1f}s",
    ]
    validation = None
    if "sft/val_loss" in m:
        validation = f"validation: loss {m['sft/val_loss']:.4f} | ppl {m['sft/val_ppl']:.2f}"
    return _with_detail_lines(" | ".join(parts), m, validation)


def _with_detail_lines(line: str, m: Mapping[str, Any], validation: str | None) -> str:
    """A step's line with, below it, the step's validation (if any), the planner's and the
    gates' summaries: the same indented detail lines whatever the kind of step."""
    details = [
        validation,
        f"plan: {m['planner/summary']}" if m.get("planner/summary") else None,
        f"gates: {m['gates/summary']}" if m.get("gates/summary") else None,
    ]
    return "".join([line, *(f"\n         {d}" for d in details if d)])


def validation_line(m: Mapping[str, Any]) -> str:
    """The console line of a validation outside a training step (step 0: the initial weights)."""
    seconds = m.get("timing_s/testing")
    took = f" | {seconds:.1f}s" if isinstance(seconds, int | float) else ""
    if "sft/val_loss" in m:
        scores = f"loss {m['sft/val_loss']:.4f} | ppl {m['sft/val_ppl']:.2f}"
        return f"step {m['step']:>3} | validation: {scores}{took}"
    return f"step {m['step']:>3} | validation: {_validation_scores(m)}{took}"


def _validation_scores(m: Mapping[str, Any]) -> str:
    """``<data_source> <mean reward>`` of every ``val-core/`` key; empty without any."""
    scores = {
        k.removeprefix("val-core/").rsplit("/reward/", 1)[0]: v
        for k, v in m.items()
        if k.startswith("val-core/")
    }
    return ", ".join(f"{s} {v:.3f}" for s, v in scores.items())


STARTUP_PREFIX = "timing_s/startup/"
"""The start-up's seconds (:class:`StartupClock`): logged with a step, but not a phase of it."""


class StartupClock:
    """Where a run's start-up went, phase by phase, up to its first step.

    Rank 0 times each phase of its set-up (building the rollout engine, the actor, the
    reference, the critic, restoring a checkpoint); :meth:`metrics` gives them as
    ``timing_s/startup/<phase>`` plus ``timing_s/startup/total`` (from the rank's entry, so it
    also holds what no phase names: process groups, the tokenizer, the data's checks). They
    are logged once, with the first step the run trains."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        times = {f"{STARTUP_PREFIX}{name}": s for name, s in self.seconds.items()}
        return {**times, f"{STARTUP_PREFIX}total": time.perf_counter() - self._start}


def startup_line(metrics: Mapping[str, float]) -> str:
    """``start-up 23.4s: rollout_host 12.1s | actor 6.0s | ...`` from the start-up metrics."""
    total = STARTUP_PREFIX + "total"
    phases = " | ".join(
        f"{key.removeprefix(STARTUP_PREFIX)} {seconds:.1f}s"
        for key, seconds in metrics.items()
        if key.startswith(STARTUP_PREFIX) and key != total
    )
    return f"start-up {metrics[total]:.1f}s: {phases}"


class PhaseTimer:
    """Collects ``timing_s/<phase>`` durations for one step."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {f"timing_s/{p}": 0.0 for p in PHASES}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as ``timing_s/<name>`` (added up if the phase repeats)."""
        key, t0 = f"timing_s/{name}", time.perf_counter()
        try:
            yield
        finally:
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0

    def add(self, phase_seconds: dict[str, float]) -> None:
        """Add durations measured elsewhere (e.g. by the rollout producer on rank 0)."""
        for name, seconds in phase_seconds.items():
            key = f"timing_s/{name}"
            self.times[key] = self.times.get(key, 0.0) + seconds

    def total(self) -> float:
        return time.perf_counter() - self._start

"""The end-of-run summary: what a run reached, where its time went, what the planner and gates
saved.

Computed from plain metric rows (the run's history, or ``metrics.jsonl`` read back), so the
console at a run's end, ``tools/summarize_run.py`` and the tests share one computation. A
:class:`RunSummary` is data -- tables of strings -- rendered as plain text (tools, tests, logs) or
as rich tables (the console).

Every number tolerates missing keys: a row without a key is left out for that key (the step-0
row of ``trainer.val_before_train`` has no reward; an older run has no planner keys), and a table
row with nothing to show is left out. Best means highest: reward and validation scores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.planner.gates import ENGINE_IS_ACTOR
from megarl.trainer.metrics import PHASES, STARTUP_PREFIX

REWARD_KEY = "critic/rewards/mean"
NO_ENGINE_SYNC = "sync: no rollout engine"
"""The gates' reason of a run without a rollout engine (``algo.objective=sft``)."""
ENGINE_IS_ACTOR_SYNC = f"sync: {ENGINE_IS_ACTOR}"
"""The gates' reason of a run whose engine is the actor's model (``rollout.engine=megatron``)."""
VALIDATION_PREFIX = "val-core/"
STEP_TIME_KEY = "timing_s/step"

Rows = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class SummaryTable:
    """One titled table of the summary; every cell already formatted."""

    title: str
    columns: tuple[str, ...]
    """Header; the first column names the row."""
    rows: tuple[tuple[str, ...], ...]
    compared: tuple[str, ...] = ()
    """The columns a comparison of runs lines up (empty: all)."""

    def text(self) -> str:
        """Plain text: the title, then columns padded to their widest cell."""
        cells = [self.columns, *self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        lines = [self.title]
        lines += [
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells
        ]
        return "\n".join(lines)

    def facts(self) -> list[tuple[str, str]]:
        """``(label, value)`` per cell of the ``compared`` columns: the row's name, plus the
        column's beyond two columns (``reward best``, ``gen per step``); what a comparison
        lines up across runs."""
        if len(self.columns) == 2:
            return [(row[0], row[1]) for row in self.rows]
        return [
            (f"{row[0]} {column}", cell)
            for row in self.rows
            for column, cell in zip(self.columns[1:], row[1:], strict=True)
            if not self.compared or column in self.compared
        ]

    def rich(self):
        """A ``rich.table.Table`` of the same cells."""
        from rich.table import Table

        table = Table(title=self.title, title_justify="left", title_style="bold")
        numbers = len(self.columns) > 2  # else the second column is words
        for index, column in enumerate(self.columns):
            table.add_column(column, justify="right" if index and numbers else "left")
        for row in self.rows:
            table.add_row(*row)
        return table


@dataclass(frozen=True)
class RunSummary:
    """The headline line and the tables of one run."""

    headline: str
    """``6 steps in 12.0s, 100 tokens/s`` (or ``no steps ran``)."""
    overview: tuple[tuple[str, str], ...]
    """The headline's numbers by label (``steps``, ``time``, ``tokens/s``), for comparisons."""
    tables: tuple[SummaryTable, ...]

    def text(self) -> str:
        return "\n\n".join([self.headline, *(t.text() for t in self.tables)])

    def facts(self, title: str) -> dict[str, str]:
        """The cells of the table ``title`` by label (see :meth:`SummaryTable.facts`); empty
        when this run has no such table."""
        return {label: value for t in self.tables if t.title == title for label, value in t.facts()}


SCORES = "scores"
TIME = "time per phase"
SAVED = "saved by the planner and gates"
_TIME_COLUMNS = ("phase", "total", "share", "per step")


def summarize(history: Rows, window: int = 3) -> RunSummary:
    """The summary of ``history`` (one row per step; validation-only rows may be among them).

    ``window``: the reward is also shown as a ``window``-step mean (first, last, best), since
    one step's reward is noisy.
    """
    steps = series(history, STEP_TIME_KEY)
    if not steps:
        return RunSummary("no steps ran", (), ())
    total = sum(v for _, v in steps)
    overview = [("steps", str(len(steps))), ("time", f"{total:.1f}s")]
    headline = f"{len(steps)} step{'' if len(steps) == 1 else 's'} in {total:.1f}s"
    throughput = series(history, "perf/throughput")
    if throughput:
        tokens_per_s = f"{_mean(v for _, v in throughput):.0f}"
        overview.append(("tokens/s", tokens_per_s))
        headline += f", {tokens_per_s} tokens/s"
    tables = [
        SummaryTable(SCORES, ("metric", "first", "last", "best"), _score_rows(history, window)),
        # per step: runs of different lengths compare fairly
        SummaryTable(TIME, _TIME_COLUMNS, _time_rows(history, total), compared=("per step",)),
        SummaryTable(SAVED, ("what", "saved"), _saving_rows(history)),
    ]
    return RunSummary(headline, tuple(overview), tuple(t for t in tables if t.rows))


def run_summary(history: Rows, window: int = 3) -> str:
    """:func:`summarize` as plain text."""
    return summarize(history, window).text()


def compare(summaries: Mapping[str, RunSummary]) -> tuple[SummaryTable, ...]:
    """The runs' summaries side by side: one column per run, rows lined up by label; a cell a
    run lacks is ``-``."""
    names = tuple(summaries)
    tables = [_lined_up("run", names, [dict(s.overview) for s in summaries.values()])]
    titles = list(dict.fromkeys(t.title for s in summaries.values() for t in s.tables))
    for title in titles:
        per_run = [s.facts(title) for s in summaries.values()]
        tables.append(_lined_up(title, names, per_run))
    return tuple(tables)


def _lined_up(title: str, names: tuple[str, ...], per_run: list[dict[str, str]]) -> SummaryTable:
    """One row per label any run has, one column per run."""
    labels = list(dict.fromkeys(label for facts in per_run for label in facts))
    rows = tuple((label, *(facts.get(label, "-") for facts in per_run)) for label in labels)
    return SummaryTable(title, ("", *names), rows)


# --- the numbers ----------------------------------------------------------------------------


def series(rows: Rows, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row holding ``key`` as a finite number (``metrics.jsonl`` has
    null for NaN); a row without ``step`` counts by position."""
    out = []
    for index, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out.append((int(row.get("step", index + 1)), float(value)))
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def validation_keys(rows: Rows) -> list[str]:
    """The ``val-core/<data_source>/.../mean@<n>`` keys, in order of first appearance."""
    keys = (k for row in rows for k in row if k.startswith(VALIDATION_PREFIX))
    return list(dict.fromkeys(keys))


def _score_rows(history: Rows, window: int) -> tuple[tuple[str, ...], ...]:
    rows = []
    reward = series(history, REWARD_KEY)
    if reward:
        rows.append(("reward", *_first_last_best(reward)))
    if window > 1 and len(reward) > window:
        rows.append((f"reward, {window}-step mean", *_windowed(reward, window)))
    scores = ((key, series(history, key)) for key in validation_keys(history))
    rows += [
        (f"val {key.removeprefix(VALIDATION_PREFIX)}", *_first_last_best(series))
        for key, series in scores
        if series
    ]
    for key, label in (("sft/loss", "loss (sft)"), ("sft/val_loss", "val loss (sft)")):
        losses = series(history, key)
        if losses:  # lower is better
            best_step, best = min(losses, key=lambda point: point[1])
            rows.append(
                (
                    label,
                    f"{losses[0][1]:.4f}",
                    f"{losses[-1][1]:.4f}",
                    f"{best:.4f} (step {best_step})",
                )
            )
    return tuple(rows)


def _first_last_best(series: list[tuple[int, float]]) -> tuple[str, str, str]:
    best_step, best = max(series, key=lambda point: point[1])  # ties: the earliest step
    return f"{series[0][1]:.3f}", f"{series[-1][1]:.3f}", f"{best:.3f} (step {best_step})"


def _windowed(series: list[tuple[int, float]], window: int) -> tuple[str, str, str]:
    """First, last and best mean of ``window`` consecutive steps."""
    means = [
        (series[i][0], series[i + window - 1][0], _mean(v for _, v in series[i : i + window]))
        for i in range(len(series) - window + 1)
    ]
    start, end, best = max(means, key=lambda m: m[2])
    return f"{means[0][2]:.3f}", f"{means[-1][2]:.3f}", f"{best:.3f} (steps {start}-{end})"


def phase_keys(rows: Rows) -> list[str]:
    """``timing_s/<phase>`` keys: ``PHASES`` first, then any other (critic, validation, engine
    sleep) in order of first appearance; never ``timing_s/step``, the whole step, nor the
    start-up's ``timing_s/startup/*``, spent before any step."""
    others = dict.fromkeys(
        k
        for row in rows
        for k in row
        if k.startswith("timing_s/") and not k.startswith(STARTUP_PREFIX) and k != STEP_TIME_KEY
    )
    known = [f"timing_s/{p}" for p in PHASES if f"timing_s/{p}" in others]
    return known + [k for k in others if k not in known]


def _time_rows(history: Rows, total: float) -> tuple[tuple[str, ...], ...]:
    """Seconds per phase over the training steps, whose ``timing_s/step`` is ``total``: a
    validation outside any step (step 0) is left out, so the shares add up to at most 100%."""
    steps = [row for row in history if series([row], STEP_TIME_KEY)]
    rows = []
    for key in phase_keys(steps):
        spent = sum(v for _, v in series(steps, key))
        share = f"{spent / total:.0%}" if total > 0 else "-"
        rows.append(
            (key.removeprefix("timing_s/"), f"{spent:.1f}s", share, f"{spent / len(steps):.2f}s")
        )
    return tuple(rows)


def _saving_rows(history: Rows) -> tuple[tuple[str, str], ...]:
    rows = [
        _pruning(history),
        _ghost_steps(history),
        _old_log_prob(history),
        _reference(history),
        _weight_sync(history),
    ]
    return tuple(row for row in rows if row is not None)


def _pruning(history: Rows) -> tuple[str, str] | None:
    """Zero-advantage pruning: the share of sequences and tokens the plan did not train."""
    kept_seqs = series(history, "planner/kept_seq_frac")
    if not kept_seqs:
        return None
    seqs = _mean(1 - v for _, v in kept_seqs)
    pruned = total = 0.0
    for row in history:
        kept, tokens = row.get("planner/kept_token_frac"), row.get("perf/total_num_tokens")
        if isinstance(kept, int | float) and isinstance(tokens, int | float):
            pruned, total = pruned + (1 - kept) * tokens, total + tokens
    detail = f"{seqs:.0%} of sequences"
    if total > 0:
        detail += f", {pruned / total:.0%} of tokens ({pruned:,.0f} of {total:,.0f})"
    return "pruned (zero advantage)", detail


def _ghost_steps(history: Rows) -> tuple[str, str] | None:
    ghosts = series(history, "planner/ghost_steps")
    optimizer = series(history, "planner/optimizer_steps")
    if not ghosts or not optimizer:
        return None
    skipped, planned = sum(v for _, v in ghosts), sum(v for _, v in optimizer)
    return "ghost steps", f"{skipped:.0f} of {planned:.0f} skipped (nothing left to train)"


def _old_log_prob(history: Rows) -> tuple[str, str] | None:
    """Old-logprob pass: sequences not recomputed (the training forward or the engine stood in)."""
    fracs = series(history, "gates/old_log_prob_frac")
    if not fracs:
        return None
    whole = sum(1 for _, v in fracs if v == 0)
    skipped = _mean(1 - v for _, v in fracs)
    detail = (
        f"skipped for {skipped:.0%} of sequences, the whole pass on {whole} of {len(fracs)} steps"
    )
    return "old-logprob recompute", detail


def _reference(history: Rows) -> tuple[str, str] | None:
    runs = series(history, "gates/ref_log_prob")
    if not runs:
        return None
    skipped = sum(1 for _, v in runs if v == 0)
    return "reference pass", f"skipped on {skipped} of {len(runs)} steps"


def _weight_sync(history: Rows) -> tuple[str, str] | None:
    """How often the base-weight gate sent base/full weights, and what syncing cost."""
    gated = [row for row in history if isinstance(row.get("gates/base_weight_sync"), int | float)]
    if not gated:
        return None
    engineless = sum(1 for row in gated if NO_ENGINE_SYNC in str(row.get("gates/reasons", "")))
    if engineless == len(gated):
        return "weight sync", f"none on {len(gated)} steps (no rollout engine)"
    if all(ENGINE_IS_ACTOR_SYNC in str(row.get("gates/reasons", "")) for row in gated):
        return "weight sync", f"none on {len(gated)} steps (the engine is the actor's model)"
    base = sum(1 for row in gated if row["gates/base_weight_sync"] > 0)
    seconds = sum(v for _, v in series(gated, "timing_s/update_weights"))
    skipped = len(gated) - base
    detail = f", adapter only on {skipped}" if skipped else ""
    return (
        "weight sync",
        f"base/full weights on {base} of {len(gated)} steps{detail} ({seconds:.2f}s)",
    )

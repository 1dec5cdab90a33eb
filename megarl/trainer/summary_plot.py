"""``summary.png``: a run's curves on one page, from plain metric rows.

Panels: the reward (``critic/rewards/mean``, with its min-max band), the validation scores
(``val-core/*``), the mean response length, ``rollout/logprob_abs_diff`` and a stacked bar per step
of the phase times (``timing_s/*``). A panel whose keys no row holds is left out (a run without
validation has no validation panel). Several runs overlay their curves, labelled by name, and put
their phase bars side by side within each step.

matplotlib is imported only here and only when a plot is drawn; the figure is built on the Agg
canvas (no pyplot, no display, no global state), so it works headless and in any thread. At the
end of a run, :func:`write_summary_plot` never raises: a plot is a convenience, and a missing
matplotlib or a plotting bug must not turn a finished run into a failed one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megarl.trainer.summary import REWARD_KEY, Rows, phase_keys, series, validation_keys

SUMMARY_PLOT = "summary.png"
RESPONSE_LENGTH_KEY = "response_length/mean"
LOGPROB_DIFF_KEY = "rollout/logprob_abs_diff"
SFT_LOSS_KEY = "sft/loss"
SFT_VAL_LOSS_KEY = "sft/val_loss"
MATPLOTLIB_MISSING = "matplotlib is not installed (pip install matplotlib)"

Runs = Mapping[str, Rows]
"""Run name (the legend's label) -> its metric rows."""


def write_summary_plot(rows: Rows, out: Path) -> bool:
    """Write the plot of one run to ``out``; on any failure say so in one line on stderr and
    return False instead of raising."""
    try:
        plot_runs({Path(out).parent.name: rows}, out)
    except ImportError:
        _warn(out, MATPLOTLIB_MISSING)
        return False
    except Exception as exc:  # noqa: BLE001 -- the run is done; a plot must not fail it
        _warn(out, f"{type(exc).__name__}: {exc}")
        return False
    return True


def _warn(out: Path, why: str) -> None:
    print(f"megarl-train: warning: {out}: summary plot not written: {why}", file=sys.stderr)


def plot_runs(runs: Runs, out: Path) -> Path:
    """Draw ``runs`` (one or more) into the PNG ``out``; raises ImportError without matplotlib.

    Written to a temporary name and renamed, so ``out`` is never a half-written file.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [(title, draw) for title, draw, present in _PANELS if present(runs)]
    columns = 2 if len(panels) > 1 else 1
    lines = max(1, math.ceil(len(panels) / columns))
    fig = Figure(figsize=(6.4 * columns, 3.6 * lines), layout="constrained")
    if not panels:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no step metrics to plot", ha="center", va="center")
    for index, (title, draw) in enumerate(panels):
        ax = fig.add_subplot(lines, columns, index + 1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        draw(ax, runs)
    fig.suptitle(" vs ".join(runs))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    fig.savefig(partial, format="png", dpi=100)
    partial.replace(out)
    return out


# --- panels ---------------------------------------------------------------------------------


def _points(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of the rows holding ``key`` as a finite number."""
    points = series(rows, key)
    return [step for step, _ in points], [value for _, value in points]


def _has(key: str) -> Callable[[Runs], bool]:
    return lambda runs: any(_points(rows, key)[0] for rows in runs.values())


def _label(runs: Runs, name: str, what: str = "") -> str | None:
    """A line's legend label: the run's name when there are several, plus what it shows."""
    parts = ([name] if len(runs) > 1 else []) + ([what] if what else [])
    return ": ".join(parts) or None


def _legend(ax, outside: bool = False) -> None:
    """The panel's legend, if any line is labelled; ``outside``: right of the axes, where it
    hides no bar."""
    if not ax.get_legend_handles_labels()[1]:
        return
    if outside:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize="small")


def _draw_reward(ax, runs: Runs) -> None:
    for name, rows in runs.items():
        steps, values = _points(rows, REWARD_KEY)
        (line,) = ax.plot(steps, values, marker=".", label=_label(runs, name))
        low, high = _points(rows, "critic/rewards/min"), _points(rows, "critic/rewards/max")
        if low[0] == steps and high[0] == steps:
            ax.fill_between(steps, low[1], high[1], color=line.get_color(), alpha=0.15)
    _legend(ax)


def _draw_validation(ax, runs: Runs) -> None:
    for name, rows in runs.items():
        for key in validation_keys(rows):
            what = key.removeprefix("val-core/")
            ax.plot(*_points(rows, key), marker="o", label=_label(runs, name, what) or what)
    _legend(ax)


def _draw_line(key: str, log_scale: bool = False):
    def draw(ax, runs: Runs) -> None:
        positive = True
        for name, rows in runs.items():
            steps, values = _points(rows, key)
            ax.plot(steps, values, marker=".", label=_label(runs, name))
            positive = positive and all(v > 0 for v in values)
        if log_scale and positive:
            ax.set_yscale("log")
        _legend(ax)

    return draw


def _draw_phases(ax, runs: Runs) -> None:
    """One stacked bar per step (runs side by side); a phase keeps its colour across runs."""
    keys = list(dict.fromkeys(k for rows in runs.values() for k in phase_keys(rows)))
    colors = {key: f"C{i % 10}" for i, key in enumerate(keys)}
    width = 0.8 / len(runs)
    for position, rows in enumerate(runs.values()):
        offset = (position - (len(runs) - 1) / 2) * width
        steps = sorted({s for key in keys for s in _points(rows, key)[0]})
        bottom = dict.fromkeys(steps, 0.0)
        for key in keys:
            seconds = dict(zip(*_points(rows, key), strict=True))
            heights = [seconds.get(s, 0.0) for s in steps]
            label = key.removeprefix("timing_s/") if position == 0 else None
            ax.bar(
                [s + offset for s in steps],
                heights,
                width,
                bottom=[bottom[s] for s in steps],
                color=colors[key],
                hatch=_HATCHES[position % len(_HATCHES)],
                label=label,
            )
            for s, h in zip(steps, heights, strict=True):
                bottom[s] += h
    ax.set_ylabel("seconds")
    if len(runs) > 1:
        ax.set_title(f"{ax.get_title()} (bars: {', '.join(runs)})")
    _legend(ax, outside=True)


_HATCHES = ("", "//", "..", "xx")


def _any_phase(runs: Runs) -> bool:
    return any(phase_keys(rows) for rows in runs.values())


def _any_validation(runs: Runs) -> bool:
    return any(_has(key)(runs) for rows in runs.values() for key in validation_keys(rows))


_PANELS: Sequence[tuple[str, Callable[[Any, Runs], None], Callable[[Runs], bool]]] = (
    ("reward (critic/rewards/mean)", _draw_reward, _has(REWARD_KEY)),
    ("SFT loss (sft/loss)", _draw_line(SFT_LOSS_KEY), _has(SFT_LOSS_KEY)),
    ("SFT validation loss (sft/val_loss)", _draw_line(SFT_VAL_LOSS_KEY), _has(SFT_VAL_LOSS_KEY)),
    ("validation (val-core)", _draw_validation, _any_validation),
    ("mean response length", _draw_line(RESPONSE_LENGTH_KEY), _has(RESPONSE_LENGTH_KEY)),
    (LOGPROB_DIFF_KEY, _draw_line(LOGPROB_DIFF_KEY, log_scale=True), _has(LOGPROB_DIFF_KEY)),
    ("time per phase", _draw_phases, _any_phase),
)

"""Checkpoint directories on disk: names, the completeness marker, discovery, atomic commit, pruning.

Pure file-system code (no torch, no process groups), unit-tested on plain folders. A checkpoint
is *complete* exactly when its directory is named ``step_N`` and holds a readable marker whose
listed files all exist; everything else (``.tmp-*``, ``.del-*``, a folder without marker) is
ignored by discovery and cleaned up by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "megarl_checkpoint.json"
FORMAT_VERSION = 1
CHECKPOINTS_SUBDIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
DELETE_PREFIX = ".del-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path and the problem."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its folder and the marker's contents."""

    path: Path
    marker: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.marker["step"])

    @property
    def kind(self) -> str:
        """``training`` (saved by the trainer) or ``converted`` (written by megarl-convert)."""
        return str(self.marker.get("kind", "training"))

    @property
    def tp(self) -> int:
        return int(self.marker["layout"]["tp"])

    @property
    def pp(self) -> int:
        return int(self.marker["layout"]["pp"])


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank}_pp{pp_rank}.safetensors"


def optim_file(tp_rank: int, pp_rank: int) -> str:
    return f"optim_tp{tp_rank}_pp{pp_rank}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_SUBDIR


def read_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Validate ``path`` as a complete checkpoint; :class:`CheckpointError` (one line) if not."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: no such directory")
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise CheckpointError(
            f"checkpoint {path}: no {MARKER} (incomplete or not a megarl checkpoint)"
        )
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {MARKER} ({exc})") from None
    if marker.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format {marker.get('format')!r} is not {FORMAT_VERSION}"
        )
    missing = [name for name in marker.get("files", []) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing file(s) {', '.join(missing[:3])}")
    return CheckpointInfo(path=path, marker=marker)


def complete_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first (broken ones skipped)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if _STEP_DIR.match(child.name) is None:
            continue
        try:
            found.append(read_checkpoint(child))
        except CheckpointError:
            continue
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(run_dir: str | os.PathLike) -> CheckpointInfo | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def write_json_durably(path: Path, payload: Any) -> None:
    """Write, flush and fsync, so the marker is on disk before the rename that publishes it."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def staging_dir(root: Path, final_name: str) -> Path:
    """The temporary name a checkpoint is written under (deterministic: all ranks agree)."""
    return root / f"{TMP_PREFIX}{final_name}"


def prepare_staging(root: Path, final_name: str) -> Path:
    """A fresh, empty staging directory (a stale one from a killed save is removed first)."""
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, final_name)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def publish(staging: Path, final: Path, marker: dict[str, Any]) -> None:
    """Write the marker last, then rename ``staging`` to ``final`` (replacing an older copy)."""
    write_json_durably(staging / MARKER, marker)
    if final.exists():  # e.g. a run resumed from an earlier step saves this step again
        _remove_safely(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_safely(path: Path) -> None:
    """Rename first (atomic), then delete: a kill mid-delete never leaves a 'complete' husk."""
    doomed = path.with_name(f"{DELETE_PREFIX}{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and leftover temp folders."""
    root = checkpoints_dir(run_dir)
    removed: list[Path] = []
    complete = complete_checkpoints(run_dir)
    for info in complete[: max(0, len(complete) - keep_last)]:
        _remove_safely(info.path)
        removed.append(info.path)
    if root.is_dir():  # called after a publish, when no save is in progress: leftovers only
        for child in root.iterdir():
            if child.name.startswith((DELETE_PREFIX, TMP_PREFIX)):
                shutil.rmtree(child, ignore_errors=True)
    return removed


def set_aside_later(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """Rename complete checkpoints newer than ``step`` to ``abandoned-<time>-step_N``.

    Resuming from step k (or starting fresh, k = 0) abandons the run's later future; left in
    place, its checkpoints would be picked by the next ``resume=auto`` or keep ``keep_last`` from
    pruning the new ones. Renamed, not deleted: nothing written is lost.
    """
    moved = []
    for info in complete_checkpoints(run_dir):
        if info.step > step:
            target = _unused(info.path.parent, "abandoned-", f"-{info.path.name}")
            os.replace(info.path, target)
            moved.append(target)
    return moved


def _unused(folder: Path, prefix: str, suffix: str) -> Path:
    """``folder/<prefix><time><suffix>``, with ``-2``, ``-3``... after the time if taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = folder / f"{prefix}{stamp}{suffix}", 1
    while candidate.exists():
        n += 1
        candidate = folder / f"{prefix}{stamp}-{n}{suffix}"
    return candidate


def rotate_metrics(metrics_path: Path) -> Path | None:
    """A fresh start keeps an earlier run's metrics under ``metrics.<time>.jsonl``."""
    if not metrics_path.is_file() or metrics_path.stat().st_size == 0:
        return None
    target = _unused(metrics_path.parent, "metrics.", ".jsonl")
    os.replace(metrics_path, target)
    return target


def truncate_metrics(metrics_path: Path, last_step: int) -> int:
    """Drop metric lines of steps after ``last_step`` (and torn lines); atomic. Returns lines kept.

    A resumed run then appends steps ``last_step + 1 ...`` and the history stays one line per step.
    """
    if not metrics_path.is_file():
        return 0
    kept: list[str] = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill
        if isinstance(record, dict) and int(record.get("step", 0)) <= last_step:
            kept.append(line)
    tmp = metrics_path.with_name(f"{TMP_PREFIX}{metrics_path.name}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(f"{line}\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, metrics_path)
    return len(kept)


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    if not metrics_path.is_file():
        return []
    rows = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows

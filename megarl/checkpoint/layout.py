"""Checkpoint directories on disk: names, the completeness marker, discovery, atomic commit, pruning.

Pure file-system code (no torch, no process groups), unit-tested on plain folders. A checkpoint
is *complete* exactly when its directory is named ``step_N`` and holds a readable marker whose
listed files all exist, have the sizes the marker recorded, and are intact as far as their
headers tell (safetensors header against the file's length, JSON that parses, a ``.pt`` zip
that closes). A ``step_N`` folder that fails any of this is *damaged*: since a save renames its
staging folder only after the marker is on disk, a damaged one was complete once and broke
later (a truncated copy, a full disk, a hand edit), so it is reported, never skipped in silence,
never removed. ``.tmp-step_N`` is a save that never finished: not a checkpoint; it is renamed
aside (``incomplete-<time>-step_N``) at the next start, and said so.

What megarl removes: only complete checkpoints of its own run directory (their marker's
``run_id`` equals the one in ``<run_dir>/.megarl_run_id``), older than the newest ``keep_last``
of them, during a save. A checkpoint copied in from elsewhere, one saved before run ids were
recorded, and every damaged or incomplete folder stay where they are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.errors import BadInputError

MARKER = "megarl_checkpoint.json"
FORMAT_VERSION = 1
CHECKPOINTS_SUBDIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
DELETE_PREFIX = ".del-"
RUN_ID_FILE = ".megarl_run_id"
HOST_STATE_FILE = "driver.json"
"""Rank 0's data-stream position (the name existing checkpoints carry)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""The files that define the token ids a checkpoint's embedding rows stand for."""


class CheckpointError(BadInputError, ValueError):
    """A checkpoint that cannot be used; the message names the path and the problem (exit 2,
    also when a rank finds it while loading)."""


class DamagedCheckpointError(CheckpointError):
    """The newest ``step_N`` folder of a run is damaged; ``older`` is the newest complete one."""

    def __init__(self, path: Path, problem: str, older: CheckpointInfo | None):
        super().__init__(problem)
        self.path, self.problem, self.older = path, problem, older


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

    @property
    def ep(self) -> int:
        """Expert-parallel size it was saved at (1 for dense models and older checkpoints)."""
        return int(self.marker["layout"].get("ep", 1))


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def model_file(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    """Expert-parallel rank 0's file holds every other parameter too; rank ``e > 0``'s holds
    only its experts (named by global expert index)."""
    suffix = f"_ep{ep_rank}" if ep_rank else ""
    return f"model_tp{tp_rank}_pp{pp_rank}{suffix}.safetensors"


def optim_file(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    suffix = f"_ep{ep_rank}" if ep_rank else ""
    return f"optim_tp{tp_rank}_pp{pp_rank}{suffix}.safetensors"


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
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        found = marker.get("format") if isinstance(marker, dict) else marker
        raise CheckpointError(f"checkpoint {path}: format {found!r} is not {FORMAT_VERSION}")
    problem = _marker_problem(marker, path.name)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {MARKER} {problem}")
    missing = [name for name in marker.get("files", []) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path}: missing file(s) {', '.join(missing[:3])}")
    sizes = marker.get("sizes", {})
    for name in marker.get("files", []):
        problem = file_problem(path / name, sizes.get(name))
        if problem is not None:
            raise CheckpointError(f"checkpoint {path}: {name} is damaged ({problem})")
    return CheckpointInfo(path=path, marker=marker)


def _marker_problem(marker: dict[str, Any], folder_name: str) -> str | None:
    """The first marker field that is missing or of the wrong type; None if all are usable."""
    step = marker.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"has step {step!r}, not a step number"
    name = _STEP_DIR.match(folder_name)
    if name is not None and int(name.group(1)) != step:
        return f"says step {step}, the folder name says {int(name.group(1))}"
    parallel = marker.get("layout")
    for key in ("tp", "pp"):
        value = parallel.get(key) if isinstance(parallel, dict) else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"has layout.{key} {value!r}, not a positive size"
    files = marker.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return "has a files entry that is not a list of names"
    if not isinstance(marker.get("sizes", {}), dict):
        return "has a sizes entry that is not a mapping"
    return None


def file_sizes(folder: Path) -> dict[str, int]:
    """Byte size of every file in ``folder``: the marker records them at save time."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def file_problem(path: Path, expected_size: int | None = None) -> str | None:
    """What is wrong with one checkpoint file, read from its size and header only; None if fine.

    Cheap enough to run on every checkpoint at start-up (no tensor is read), and catches what a
    torn copy or a full disk leaves: a short file, a safetensors header pointing past the end, a
    JSON file that does not parse, a ``torch.save`` zip without its closing directory.
    """
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        return f"{size} bytes, the marker recorded {expected_size}"
    if path.suffix == ".safetensors":
        return _safetensors_problem(path, size)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"not valid JSON: {exc}"
    if path.suffix == ".pt" and not zipfile.is_zipfile(path):
        return "not a complete torch.save archive"
    return None


def _safetensors_problem(path: Path, size: int) -> str | None:
    """The header (8-byte length, then JSON) must fit and its tensors must end at the file end."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            return f"{size} bytes, its header alone needs {8 + header_len}"
        try:
            header = json.loads(handle.read(header_len))
        except ValueError:
            return "unreadable safetensors header"
    ends = [
        int(entry["data_offsets"][1])
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    needed = 8 + header_len + max(ends, default=0)
    if needed != size:
        return f"{size} bytes, its tensors need {needed}"
    return None


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A ``step_N`` folder that is not a complete checkpoint, and why (one line)."""

    path: Path
    step: int
    problem: str


@dataclass(frozen=True)
class CheckpointScan:
    """Everything under ``run_dir/checkpoints``, sorted into what start-up must act on."""

    complete: tuple[CheckpointInfo, ...]
    """Complete checkpoints, oldest first."""
    damaged: tuple[DamagedCheckpoint, ...]
    """``step_N`` folders that fail :func:`read_checkpoint`, oldest first."""
    staging: tuple[Path, ...]
    """``.tmp-step_N`` folders of saves that never finished."""


def scan_checkpoints(run_dir: str | os.PathLike) -> CheckpointScan:
    root = checkpoints_dir(run_dir)
    complete: list[CheckpointInfo] = []
    damaged: list[DamagedCheckpoint] = []
    staging: list[Path] = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if child.name.startswith(TMP_PREFIX):
            staging.append(child)
        if match is None:
            continue
        try:
            complete.append(read_checkpoint(child))
        except CheckpointError as exc:
            damaged.append(DamagedCheckpoint(child, int(match.group(1)), str(exc)))
    return CheckpointScan(
        complete=tuple(sorted(complete, key=lambda info: info.step)),
        damaged=tuple(sorted(damaged, key=lambda d: d.step)),
        staging=tuple(staging),
    )


def complete_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first."""
    return list(scan_checkpoints(run_dir).complete)


def latest_checkpoint(run_dir: str | os.PathLike) -> CheckpointInfo | None:
    """The newest complete checkpoint; :class:`DamagedCheckpointError` if a damaged one is newer.

    Falling back to an older checkpoint would silently throw away the steps after it, so the
    caller decides (and says) what to do instead.
    """
    scan = scan_checkpoints(run_dir)
    newest = scan.complete[-1] if scan.complete else None
    newest_damaged = scan.damaged[-1] if scan.damaged else None
    if newest_damaged is not None and (newest is None or newest_damaged.step >= newest.step):
        raise DamagedCheckpointError(newest_damaged.path, newest_damaged.problem, newest)
    return newest


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
    """A fresh, empty staging directory (a stale one from a killed save is renamed aside)."""
    root.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(root, final_name)
    if staging.exists():
        set_aside(staging, "incomplete-")
    staging.mkdir()
    return staging


def publish(staging: Path, final: Path, marker: dict[str, Any]) -> Path | None:
    """Write the marker last, then rename ``staging`` to ``final``.

    A folder already at ``final`` (start-up sets later steps aside, so only a folder that
    appeared meanwhile) is renamed aside, never replaced; returns its new path, else None.
    """
    write_json_durably(staging / MARKER, marker)
    moved = set_aside(final, "replaced-") if final.exists() else None
    os.replace(staging, final)
    _fsync_dir(final.parent)
    return moved


def run_id(run_dir: str | os.PathLike) -> str:
    """This run directory's id (created on first use): the marker records it, pruning reads it.

    A file in the run directory rather than its path, so a run directory that was moved keeps
    rotating its own checkpoints, while a checkpoint copied in from another run is never removed.
    """
    path = Path(run_dir) / RUN_ID_FILE
    if path.is_file():
        existing = path.read_text(encoding="utf-8").strip()
        if existing:
            return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    path.write_text(new + "\n", encoding="utf-8")
    return new


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
    """Rename first (atomic), then delete: a kill mid-delete never leaves a 'complete' husk.

    The new name is unique, so a ``.del-`` folder left by an earlier kill is never touched.
    """
    doomed = path.with_name(f"{DELETE_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prunable(scan: CheckpointScan, keep_last: int, own_run_id: str) -> list[CheckpointInfo]:
    """Which checkpoints rotation removes: complete ones this run directory wrote (marker
    ``run_id``), all but the newest ``keep_last`` of them, and never the newest complete one."""
    own = [info for info in scan.complete if info.marker.get("run_id") == own_run_id]
    doomed = own[: max(0, len(own) - keep_last)]
    newest = scan.complete[-1] if scan.complete else None
    return [info for info in doomed if newest is None or info.path != newest.path]


def prune(run_dir: str | os.PathLike, keep_last: int, own_run_id: str) -> list[Path]:
    """Delete the checkpoints :func:`prunable` picks; nothing else (see the module docstring)."""
    removed = []
    for info in prunable(scan_checkpoints(run_dir), keep_last, own_run_id):
        _remove_safely(info.path)
        removed.append(info.path)
    return removed


def set_aside(path: Path, prefix: str) -> Path:
    """Rename ``path`` to ``<prefix><time>-<name>`` beside it (never over an existing folder)."""
    target = _unused(path.parent, prefix, f"-{path.name.removeprefix(TMP_PREFIX)}")
    os.replace(path, target)
    return target


def set_aside_later(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """Rename ``step_N`` folders with N > ``step``, complete or damaged, to ``abandoned-...``.

    Resuming from step k (or starting fresh, k = 0) abandons the run's later future; left in
    place, its checkpoints would be picked by the next ``resume=auto``, or be in the way of the
    new saves of the same steps. Renamed, not deleted: nothing written is lost.
    """
    scan = scan_checkpoints(run_dir)
    later = [info.path for info in scan.complete if info.step > step]
    later += [d.path for d in scan.damaged if d.step > step]
    return [set_aside(path, "abandoned-") for path in sorted(later)]


def set_aside_staging(run_dir: str | os.PathLike) -> list[Path]:
    """Rename ``.tmp-step_N`` folders of saves that never finished to ``incomplete-...``."""
    return [set_aside(path, "incomplete-") for path in scan_checkpoints(run_dir).staging]


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


def rotate_tensorboard(tensorboard_dir: Path) -> Path | None:
    """A fresh start keeps an earlier run's TensorBoard events under ``tensorboard.<time>``.

    Left in ``tensorboard/``, the old events of the steps the new run has not reached yet would
    be drawn on the new run's curves (``purge_step`` hides only steps the new run writes again).
    Beside it, ``tensorboard --logdir <run_dir>`` shows the old run as a run of its own.
    """
    if not tensorboard_dir.is_dir() or not any(tensorboard_dir.iterdir()):
        return None
    target = _unused(tensorboard_dir.parent, "tensorboard.", "")
    os.replace(tensorboard_dir, target)
    return target


@dataclass(frozen=True)
class MetricsCut:
    """What :func:`truncate_metrics` did to ``metrics.jsonl``."""

    kept: int
    """Lines kept: one per step up to the checkpoint's step."""
    later: int
    """Lines of steps after the checkpoint (the abandoned future), dropped."""
    torn: int
    """Lines that did not parse (a write cut by a kill), dropped."""
    duplicates: int
    """Earlier lines of a step that appears again (the last one is kept), dropped."""


def truncate_metrics(metrics_path: Path, last_step: int) -> MetricsCut:
    """Keep one line per step up to ``last_step``, in step order; atomic.

    A resumed run then appends steps ``last_step + 1 ...`` and the history stays one line per
    step. A torn line cannot be parsed and so cannot be kept; the caller reports the counts.
    """
    if not metrics_path.is_file():
        return MetricsCut(0, 0, 0, 0)
    by_step: dict[int, str] = {}
    later = torn = duplicates = 0
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        step = _metrics_step(line)
        if step is None:
            torn += line.strip() != ""
        elif step > last_step:
            later += 1
        else:
            duplicates += step in by_step
            by_step[step] = line
    tmp = metrics_path.with_name(f"{TMP_PREFIX}{metrics_path.name}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(f"{by_step[step]}\n" for step in sorted(by_step)))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, metrics_path)
    return MetricsCut(len(by_step), later, torn, duplicates)


def _metrics_step(line: str) -> int | None:
    """The step of one metrics line, or None when it is not a JSON object with an int step."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` that parse (a torn line is not a row)."""
    if not metrics_path.is_file():
        return []
    rows = []
    for line in metrics_path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows

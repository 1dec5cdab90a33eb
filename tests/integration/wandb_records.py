"""Read what wandb wrote offline: the runs under a ``WANDB_DIR`` and their history records.

wandb's Python package no longer ships a reader for its ``run-<id>.wandb`` files, so this reads
the format directly: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB-log
records in 32 KiB blocks, each a 7-byte header (crc32, length, type: 1 full, 2 first,
3 middle, 4 last) and a piece of one serialised ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 32768
FILE_HEADER = 7
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class OfflineRun:
    """One ``wandb.init`` ... ``finish`` written offline."""

    folder: Path
    run_id: str
    project: str
    name: str
    config: dict[str, Any]
    history: list[dict[str, Any]]
    """Every ``log`` call's values, JSON-decoded, with ``_step``."""
    finished: bool
    """An exit record was written (``finish`` ran)."""


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb run file")
    pos, pieces = FILE_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD_HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pieces += data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(folder: Path) -> OfflineRun:
    [path] = folder.glob("run-*.wandb")
    run_id = project = name = ""
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    finished = False
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id, project = record.run.run_id, record.run.project
            name = record.run.display_name
            config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "exit":
            finished = True
    return OfflineRun(folder, run_id, project, name, config, history, finished)


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under ``wandb_dir`` (``WANDB_DIR``), in the order they were written
    (their folder names have a one-second clock and so may tie)."""
    folders = (Path(wandb_dir) / "wandb").glob("offline-run-*")
    runs = [read_run(f) for f in folders]
    return sorted(runs, key=lambda r: next(r.folder.glob("run-*.wandb")).stat().st_mtime_ns)

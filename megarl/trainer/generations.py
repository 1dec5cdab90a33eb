"""Generations dumps (verl's ``trainer.rollout_data_dir`` and ``trainer.validation_data_dir``):
one JSONL file per step, ``<dir>/<step>.jsonl``, one line per sequence, written by the rollout
host (rank 0, or the split rollout actor) only.

Never over another file: a step file is written under a temporary name and published with
``os.link``, which fails when the name exists, so neither a second run nor a race overwrites
one (the step is then skipped with a warning). Start-up refuses, in one line, a folder that
already holds a step file this run is going to write (:func:`conflicting_step_files`): another
run's, or the steps an interrupted run dumped after the checkpoint a resume continues from.
Files of earlier steps (a resume's own past) are left as they are.

Pure Python on plain values, apart from the file writes.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STEP_FILE = re.compile(r"^(\d+)\.jsonl$")


def step_file_steps(names: Iterable[str]) -> list[int]:
    """The steps of the ``<step>.jsonl`` names among ``names``, ascending."""
    return sorted(int(m.group(1)) for name in names if (m := STEP_FILE.match(name)))


def conflicting_step_files(folder: Path, first_step: int, step_zero: bool = False) -> list[str]:
    """Step files in ``folder`` that a run writing steps ``first_step`` onwards (and step 0 when
    ``step_zero``) would write again; empty when the folder does not exist."""
    if not folder.is_dir():
        return []
    steps = step_file_steps(p.name for p in folder.iterdir())
    return [f"{s}.jsonl" for s in steps if s >= first_step or (step_zero and s == 0)]


def rollout_records(
    step: int,
    texts: Sequence[tuple[str, str, str]],
    rewards: Sequence[float],
    advantages: Sequence[float],
    group_ids: Sequence[int],
    trained: Iterable[int],
    turns: Sequence[Sequence[tuple[str, bool]]] | None = None,
    branches: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """One record per sequence of a training step.

    ``texts[i]`` is sequence ``i``'s (prompt, response, ground-truth answer); ``trained`` the
    sequences the step's plan trains (the rest were pruned: zero advantage). ``turns`` (agent
    loops): each response as (text, trained) pieces, shown as ``turns``: the model's turns
    (``"trained": true``) and the observations between them (``false``), special tokens kept.
    ``branches`` (gateway sessions that forked): each sequence's branch number within its
    sample (0: the first), shown as ``branch`` with the branch's own ``prompt_ids_text``.
    """
    kept = set(trained)
    records = [
        {
            "step": step,
            "group": int(group_ids[i]),
            "prompt": prompt,
            "response": response,
            "answer": answer,
            "reward": float(rewards[i]),
            "advantage": float(advantages[i]),
            "trained": i in kept,
        }
        for i, (prompt, response, answer) in enumerate(texts)
    ]
    if turns is not None:
        for record, pieces in zip(records, turns, strict=True):
            record["turns"] = [{"text": text, "trained": flag} for text, flag in pieces]
    if branches is not None:
        for record, branch in zip(records, branches, strict=True):
            record["branch"] = branch
    return records


def validation_records(
    step: int,
    data_sources: Sequence[str],
    texts: Sequence[tuple[str, str, str]],
    rewards: Sequence[float],
) -> list[dict[str, Any]]:
    """One record per validation sample: its data source, texts and reward."""
    return [
        {
            "step": step,
            "data_source": data_sources[i] or "unknown",
            "prompt": prompt,
            "response": response,
            "answer": answer,
            "reward": float(rewards[i]),
        }
        for i, (prompt, response, answer) in enumerate(texts)
    ]


def write_step_file(folder: Path, step: int, records: Sequence[Mapping[str, Any]]) -> Path | None:
    """``<folder>/<step>.jsonl``, complete or not at all, never over an existing file (then a
    warning on stderr and None)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{step}.jsonl"
    tmp = folder / f".{step}.jsonl.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        print(
            f"megarl-train: warning: {final} exists (written by another run); step {step}'s "
            "generations were not written",
            file=sys.stderr,
            flush=True,
        )
        return None
    finally:
        tmp.unlink()
    return final

"""Which checkpoint a run resumes from, and whether its config is compatible (no torch).

``trainer.resume``: ``auto`` = the latest complete checkpoint under ``run_dir/checkpoints`` (none
-> a fresh start), ``never`` = always start fresh, anything else = that checkpoint's path (which
must be complete).

Compatibility policy. Resuming continues *the same run*; settings that would make the saved state
mean something else are errors, everything else may change and is reported:

- the model's architecture (every :class:`TransformerSpec` field: family, vocab, shapes, RoPE...)
  and ``model.*`` that picks the weights: ``model.path``, ``model.hf_config``, ``model.init_seed``
  (the reference model is the initial model), ``model.dtype`` (bitwise state would change);
- ``trainer.seed``: it fixes the prompt order and every step's sampling stream, so the saved data
  position and the rollouts after the resume only continue the run under the same seed;
- the problem set (``data.task``, ``data.path``, ``data.max_operand``, ``data.ops``): the saved
  stream position indexes it;
- ``actor.lora.rank`` and ``actor.lora.target_modules``: they change which parameters (and
  optimizer states) exist.

Allowed, reported on the console: ``trainer.total_steps`` (extend a run), logging, the parallel
layout (``actor.tp/pp``, ``trainer.n_gpus_per_node``: the checkpoint is resharded), learning
rate and other hyper-parameters (a deliberate user change).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.checkpoint.layout import (
    CheckpointError,
    CheckpointInfo,
    latest_checkpoint,
    read_checkpoint,
    rotate_metrics,
    set_aside_later,
    truncate_metrics,
)

MUST_MATCH = (
    "model.path",
    "model.hf_config",
    "model.init_seed",
    "model.dtype",
    "trainer.seed",
    "data.task",
    "data.path",
    "data.max_operand",
    "data.ops",
    "actor.lora.rank",
    "actor.lora.target_modules",
)
NOT_REPORTED = ("trainer.resume",)


@dataclass(frozen=True)
class ConfigDiff:
    errors: tuple[str, ...]
    """``key: saved -> now`` for keys that must match."""
    changes: tuple[str, ...]
    """``key: saved -> now`` for keys that may change."""


def config_tree(cfg) -> dict[str, Any]:
    """A RunConfig as plain JSON data (tuples become lists), as stored in the marker."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; mappings under a MUST_MATCH key stay whole."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name not in MUST_MATCH:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = list(value) if isinstance(value, tuple) else value
    return flat


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in patterns)


def compare_configs(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    saved_spec: Mapping[str, Any] | None = None,
    current_spec: Mapping[str, Any] | None = None,
) -> ConfigDiff:
    """Differences between a checkpoint's run config (and model spec) and this run's."""
    old, new = flatten(saved), flatten(current)
    errors, changes = [], []
    for key in sorted(set(old) | set(new)):
        if _matches(key, NOT_REPORTED) or old.get(key) == new.get(key):
            continue
        line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        (errors if _matches(key, MUST_MATCH) else changes).append(line)
    if saved_spec is not None and current_spec is not None:
        errors.extend(
            f"model {key}: {saved_spec.get(key)!r} -> {current_spec.get(key)!r}"
            for key in sorted(set(saved_spec) | set(current_spec))
            if saved_spec.get(key) != current_spec.get(key)
        )
    return ConfigDiff(errors=tuple(errors), changes=tuple(changes))


def find_resume_checkpoint(resume: str, run_dir: str) -> CheckpointInfo | None:
    """The checkpoint ``trainer.resume`` points at, or None for a fresh start."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    info = read_checkpoint(resume)
    if info.kind != "training":
        raise CheckpointError(
            f"trainer.resume={resume}: a converted checkpoint holds no "
            "training state; use it as model.path instead"
        )
    return info


def check_compatible(
    info: CheckpointInfo, current_config: Mapping[str, Any], current_spec: Mapping[str, Any]
) -> tuple[str, ...]:
    """Raise :class:`CheckpointError` naming the fields that must match; return allowed changes."""
    diff = compare_configs(
        info.marker.get("config", {}), current_config, info.marker.get("spec"), current_spec
    )
    if diff.errors:
        raise CheckpointError(
            f"checkpoint {info.path} does not match this run: " + "; ".join(diff.errors)
        )
    return diff.changes


def prepare_resume(cfg, device: str, model_spec: Callable[[], Mapping[str, Any]]) -> str | None:
    """Pick and check the checkpoint to resume (None = fresh start) and tidy ``run_dir`` for it.

    Resuming from step k: ``metrics.jsonl`` is cut back to step k (one line per step after the
    resume) and checkpoints of later steps in this run_dir are renamed aside. A fresh start sets
    all earlier checkpoints and the old ``metrics.jsonl`` aside. Nothing is deleted; what was
    done is printed. Raises :class:`CheckpointError` (one line) for a bad or mismatched checkpoint.
    """
    run_dir = cfg.trainer.run_dir
    if device == "cuda" and cfg.trainer.save_interval > 0:
        raise CheckpointError(
            "trainer.save_interval > 0: training checkpoints of Megatron's CUDA "
            "optimizer are not implemented yet (CPU only)"
        )
    info = find_resume_checkpoint(cfg.trainer.resume, run_dir)
    if info is None:
        _start_fresh(run_dir)
        return None
    if device == "cuda":
        raise CheckpointError(
            "trainer.resume: resuming on CUDA is not implemented yet; use trainer.resume=never"
        )
    changes = check_compatible(info, config_tree(cfg), model_spec())
    truncate_metrics(Path(run_dir) / "metrics.jsonl", info.step)
    moved = set_aside_later(run_dir, info.step)
    note = f"; changed settings: {'; '.join(changes)}" if changes else ""
    note += f"; later checkpoints set aside: {', '.join(p.name for p in moved)}" if moved else ""
    print(f"megarl-train: resuming from {info.path} (step {info.step}){note}", flush=True)
    return str(info.path)


def _start_fresh(run_dir: str) -> None:
    moved = [p.name for p in set_aside_later(run_dir, 0)]
    rotated = rotate_metrics(Path(run_dir) / "metrics.jsonl")
    moved += [rotated.name] if rotated else []
    if moved:
        print(
            f"megarl-train: starting fresh in {run_dir}; set aside: {', '.join(moved)}", flush=True
        )

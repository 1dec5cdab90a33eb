"""Which checkpoint a run resumes from, and whether its config is compatible (no torch).

``trainer.resume``: ``auto`` = the newest checkpoint under ``run_dir/checkpoints`` (none at all
-> a fresh start), ``never`` = start fresh, anything else = that checkpoint's path (which must be
complete). When the newest ``step_N`` folder is damaged, ``auto`` stops with one line naming it
and the two ways on (the older complete checkpoint by path, or ``never``) instead of falling back
on its own: a fallback would quietly throw away every step after the older checkpoint.

Nothing in ``run_dir`` is touched until every check below has passed; then what does not belong
to the continued run is renamed aside, never deleted, and each rename is printed: checkpoints of
later steps (``abandoned-<time>-step_N``), saves that never finished (``incomplete-...``), on a
fresh start all checkpoints, the old ``metrics.jsonl`` (``metrics.<time>.jsonl``) and the old
TensorBoard events (``tensorboard.<time>``).

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

Checked against the run before anything is loaded: the checkpoint's files (sizes and headers,
:func:`megarl.checkpoint.layout.read_checkpoint`), the tokenizer's vocabulary (the saved embedding
rows stand for its token ids), and the saved data position against this run's dataset (its
length, the seed of its order).

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
    HOST_STATE_FILE,
    CheckpointError,
    CheckpointInfo,
    DamagedCheckpointError,
    latest_checkpoint,
    read_checkpoint,
    rotate_metrics,
    rotate_tensorboard,
    scan_checkpoints,
    set_aside_later,
    set_aside_staging,
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
    if saved_spec is not None and current_spec is not None:  # the most telling, so first
        errors.extend(
            f"model {key}: {saved_spec.get(key)!r} -> {current_spec.get(key)!r}"
            for key in sorted(set(saved_spec) | set(current_spec))
            if saved_spec.get(key) != current_spec.get(key)
        )
    for key in sorted(set(old) | set(new)):
        if _matches(key, NOT_REPORTED) or old.get(key) == new.get(key):
            continue
        line = f"{key}: {describe_change(old.get(key), new.get(key))}"
        (errors if _matches(key, MUST_MATCH) else changes).append(line)
    return ConfigDiff(errors=tuple(errors), changes=tuple(changes))


def describe_change(old: Any, new: Any, most: int = 3) -> str:
    """``old -> new`` in a few words: for two mappings (a model's whole ``hf_config``) only the
    entries that differ, at most ``most`` of them; a whole mapping against anything else by its
    size."""

    def short(value: Any) -> str:
        return f"{{{len(value)} entries}}" if isinstance(value, Mapping) else repr(value)

    if not (isinstance(old, Mapping) and isinstance(new, Mapping)):
        return f"{short(old)} -> {short(new)}"
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:most])
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return f"{shown}{more}"


def find_resume_checkpoint(resume: str, run_dir: str) -> CheckpointInfo | None:
    """The checkpoint ``trainer.resume`` points at, or None for a fresh start."""
    if resume == "never":
        return None
    if resume == "auto":
        try:
            return latest_checkpoint(run_dir)
        except DamagedCheckpointError as exc:
            raise CheckpointError(_damaged_newest_message(exc)) from None
    info = read_checkpoint(resume)
    if info.kind != "training":
        raise CheckpointError(
            f"trainer.resume={resume}: a converted checkpoint holds no "
            "training state; use it as model.path instead"
        )
    return info


def _damaged_newest_message(exc: DamagedCheckpointError) -> str:
    way_on = (
        f"resume from the older complete one with trainer.resume={exc.older.path} "
        f"(steps after {exc.older.step} are then set aside), or start fresh with "
        "trainer.resume=never"
        if exc.older is not None
        else "start fresh with trainer.resume=never"
    )
    return (
        f"{exc.problem}; trainer.resume=auto does not skip the newest checkpoint: repair it, "
        f"{way_on} (nothing is deleted either way)"
    )


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


def check_tokenizer(info: CheckpointInfo, model_dir: str | Path) -> None:
    """The run's tokenizer must have the vocabulary the checkpoint was trained with."""
    for name in VOCAB_FILES:
        saved = info.path / name
        if not saved.is_file():
            continue
        current = Path(model_dir) / name
        if not current.is_file():
            raise CheckpointError(
                f"checkpoint {info.path} has {name} but this run's model {model_dir} has none"
            )
        if _vocabulary(saved) != _vocabulary(current):
            raise CheckpointError(
                f"checkpoint {info.path}: the tokenizer vocabulary in {name} differs from "
                f"this run's model ({current}); its embedding rows stand for other tokens"
            )


VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
"""The tokenizer files that define token ids (the other tokenizer files hold settings)."""


def _vocabulary(path: Path) -> Any:
    """What fixes the token ids in one tokenizer file (parsed, so formatting does not count)."""
    if path.name == "tokenizer.json":
        tree = json.loads(path.read_text(encoding="utf-8"))
        added = [(t.get("id"), t.get("content")) for t in tree.get("added_tokens") or []]
        return (tree.get("model", {}).get("vocab"), tree.get("model", {}).get("merges"), added)
    if path.name == "vocab.json":
        return json.loads(path.read_text(encoding="utf-8"))
    return path.read_bytes()


def check_data_position(info: CheckpointInfo, load_position: Callable[[Any], None]) -> None:
    """Hand the saved data-stream state to ``load_position`` (a throw-away stream of this run's
    dataset, which raises ``ValueError`` when the position does not fit it)."""
    path = info.path / HOST_STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        load_position(state["stream"])
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {info.path}: its data position does not fit this run's dataset "
            f"({type(exc).__name__}: {exc})"
        ) from None


@dataclass(frozen=True)
class RunChecks:
    """What :func:`prepare_resume` checks a checkpoint against, supplied by the launcher."""

    model_spec: Callable[[], Mapping[str, Any]]
    """This run's model spec as a dict (the checkpoint's ``spec`` must equal it)."""
    model_dir: str | None = None
    """This run's model folder, for the tokenizer check (None: not checked)."""
    load_position: Callable[[Any], None] | None = None
    """Loads a saved data-stream state into a throw-away stream of this run (None: not checked)."""


def prepare_resume(cfg, checks: RunChecks) -> str | None:
    """Pick and check the checkpoint to resume (None = fresh start), then tidy ``run_dir`` for it.

    Every check comes first, so a refused resume leaves ``run_dir`` as it was. Resuming from
    step k: ``metrics.jsonl`` is cut back to step k (one line per step after the resume) and
    ``step_N`` folders with N > k are renamed aside. A fresh start sets all checkpoints, the old
    ``metrics.jsonl`` and the old ``tensorboard/`` aside. Nothing is deleted; what was done is printed. Raises
    :class:`CheckpointError` (one line) for a bad, damaged or mismatched checkpoint.
    """
    run_dir = cfg.trainer.run_dir
    info = find_resume_checkpoint(cfg.trainer.resume, run_dir)
    if info is None:
        _start_fresh(run_dir)
        return None
    changes = check_compatible(info, config_tree(cfg), checks.model_spec())
    if checks.model_dir is not None:
        check_tokenizer(info, checks.model_dir)
    if checks.load_position is not None:
        check_data_position(info, checks.load_position)
    notes = _tidy_for_resume(run_dir, info.step)
    if changes:
        notes.insert(0, f"changed settings: {'; '.join(changes)}")
    note = "".join(f"; {n}" for n in notes)
    print(f"megarl-train: resuming from {info.path} (step {info.step}){note}", flush=True)
    return str(info.path)


def _tidy_for_resume(run_dir: str, step: int) -> list[str]:
    """Set aside what does not belong to a run resumed at ``step``; the notes to print."""
    notes = []
    older_damaged = [d for d in scan_checkpoints(run_dir).damaged if d.step <= step]
    if older_damaged:
        names = ", ".join(d.path.name for d in older_damaged)
        notes.append(f"damaged older checkpoint(s) left in place, not used: {names}")
    staged = set_aside_staging(run_dir)
    if staged:
        notes.append(f"unfinished saves set aside: {', '.join(p.name for p in staged)}")
    cut = truncate_metrics(Path(run_dir) / "metrics.jsonl", step)
    if cut.torn or cut.duplicates:
        notes.append(
            f"metrics.jsonl: dropped {cut.torn} torn line(s) (a write cut by a kill) and "
            f"{cut.duplicates} repeated step line(s)"
        )
    moved = set_aside_later(run_dir, step)
    if moved:
        notes.append(f"later checkpoints set aside: {', '.join(p.name for p in moved)}")
    return notes


def _start_fresh(run_dir: str) -> None:
    moved = [p.name for p in set_aside_staging(run_dir)]
    moved += [p.name for p in set_aside_later(run_dir, 0)]
    rotated = rotate_metrics(Path(run_dir) / "metrics.jsonl")
    moved += [rotated.name] if rotated else []
    old_events = rotate_tensorboard(Path(run_dir) / "tensorboard")
    moved += [old_events.name] if old_events else []
    if moved:
        print(
            f"megarl-train: starting fresh in {run_dir}; set aside: {', '.join(moved)}", flush=True
        )

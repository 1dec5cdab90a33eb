"""Checkpoint folders on plain files: completeness, discovery, pruning, metrics cut, config policy."""

from __future__ import annotations

import json

import pytest

from megarl.checkpoint import layout
from megarl.checkpoint.layout import CheckpointError
from megarl.checkpoint.resume import check_compatible, compare_configs, find_resume_checkpoint


def _save(run_dir, step: int, kind: str = "training") -> None:
    root = layout.checkpoints_dir(run_dir)
    staging = layout.prepare_staging(root, layout.step_dir_name(step))
    (staging / "model_tp0_pp0.safetensors").write_bytes(b"x")
    marker = {
        "format": layout.FORMAT_VERSION,
        "kind": kind,
        "step": step,
        "layout": {"tp": 1, "pp": 1},
        "files": ["model_tp0_pp0.safetensors"],
        "config": {"trainer": {"seed": 1, "total_steps": 3}},
        "spec": {"vocab_size": 8},
    }
    layout.publish(staging, root / layout.step_dir_name(step), marker)


def test_only_published_checkpoints_with_all_files_count(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 3)
    root = layout.checkpoints_dir(tmp_path)
    (root / "step_000009").mkdir()  # no marker: a foreign or broken folder
    layout.prepare_staging(root, "step_000007")  # a save killed half-way
    assert [c.step for c in layout.complete_checkpoints(tmp_path)] == [1, 3]
    (root / "step_000003" / "model_tp0_pp0.safetensors").unlink()
    assert layout.latest_checkpoint(tmp_path).step == 1
    with pytest.raises(CheckpointError, match="missing file"):
        layout.read_checkpoint(root / "step_000003")
    with pytest.raises(CheckpointError, match="no megarl_checkpoint.json"):
        layout.read_checkpoint(root / "step_000009")
    with pytest.raises(CheckpointError, match="no such directory"):
        layout.read_checkpoint(tmp_path / "absent")


def test_publish_replaces_an_existing_step_and_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 2, 3, 4):
        _save(tmp_path, step)
    root = layout.checkpoints_dir(tmp_path)
    layout.prepare_staging(root, "step_000005")
    removed = layout.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step_000001", "step_000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]


def test_truncate_metrics_drops_later_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(rows) + '\n{"step": 5, "x"')
    assert layout.truncate_metrics(path, 2) == 2
    assert [r["step"] for r in layout.read_metrics(path)] == [1, 2]


def test_config_policy_separates_errors_from_allowed_changes():
    saved = {
        "trainer": {"seed": 1, "total_steps": 3, "resume": "auto"},
        "model": {"hf_config": {"hidden_size": 8}},
        "actor": {"lr": 1.0, "tp": 2},
    }
    now = {
        "trainer": {"seed": 2, "total_steps": 6, "resume": "never"},
        "model": {"hf_config": {"hidden_size": 16}},
        "actor": {"lr": 2.0, "tp": 1},
    }
    diff = compare_configs(saved, now, {"vocab_size": 8}, {"vocab_size": 9})
    assert diff.errors == (
        "model.hf_config: {'hidden_size': 8} -> {'hidden_size': 16}",
        "trainer.seed: 1 -> 2",
        "model vocab_size: 8 -> 9",
    )
    assert diff.changes == (
        "actor.lr: 1.0 -> 2.0",
        "actor.tp: 2 -> 1",
        "trainer.total_steps: 3 -> 6",
    )


def test_resume_modes(tmp_path):
    assert find_resume_checkpoint("auto", str(tmp_path)) is None
    _save(tmp_path, 2)
    assert find_resume_checkpoint("never", str(tmp_path)) is None
    info = find_resume_checkpoint("auto", str(tmp_path))
    assert info.step == 2
    assert check_compatible(
        info, {"trainer": {"seed": 1, "total_steps": 5}}, {"vocab_size": 8}
    ) == ("trainer.total_steps: 3 -> 5",)
    with pytest.raises(CheckpointError, match="trainer.seed: 1 -> 4"):
        check_compatible(info, {"trainer": {"seed": 4, "total_steps": 3}}, {"vocab_size": 8})
    other = tmp_path / "other"
    _save(other, 1, kind="converted")
    with pytest.raises(CheckpointError, match="converted checkpoint"):
        find_resume_checkpoint(str(layout.checkpoints_dir(other) / "step_000001"), str(tmp_path))


def test_later_checkpoints_and_old_metrics_are_set_aside_not_deleted(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    moved = layout.set_aside_later(tmp_path, 1)
    assert sorted(p.name.split("-")[-1] for p in moved) == ["step_000002", "step_000003"]
    assert all(p.name.startswith("abandoned-") and p.is_dir() for p in moved)
    assert [c.step for c in layout.complete_checkpoints(tmp_path)] == [1]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    rotated = layout.rotate_metrics(metrics)
    assert not metrics.exists() and rotated.read_text() == '{"step": 1}\n'
    assert layout.rotate_metrics(metrics) is None
    metrics.write_text('{"step": 2}\n')
    again = layout.rotate_metrics(metrics)  # within the same second: a new name, no overwrite
    assert again != rotated and rotated.read_text() == '{"step": 1}\n'

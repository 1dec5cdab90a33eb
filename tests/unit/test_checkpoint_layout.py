"""Checkpoint folders on plain files: completeness, discovery, pruning, metrics cut, config policy."""

from __future__ import annotations

import json
import struct

import pytest

from megarl.checkpoint import layout
from megarl.checkpoint.layout import CheckpointError, DamagedCheckpointError
from megarl.checkpoint.resume import check_compatible, compare_configs, find_resume_checkpoint

RUN = "run-a"
SHARD = "model_tp0_pp0.safetensors"


def safetensors_bytes(n_floats: int = 4) -> bytes:
    """A valid safetensors file of one float32 tensor (header + data), written by hand."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}
    ).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)


def _save(run_dir, step: int, kind: str = "training", run_id: str | None = RUN) -> None:
    root = layout.checkpoints_dir(run_dir)
    staging = layout.prepare_staging(root, layout.step_dir_name(step))
    (staging / SHARD).write_bytes(safetensors_bytes())
    marker = {
        "format": layout.FORMAT_VERSION,
        "kind": kind,
        "step": step,
        "layout": {"tp": 1, "pp": 1},
        "files": [SHARD],
        "sizes": layout.file_sizes(staging),
        "config": {"trainer": {"seed": 1, "total_steps": 3}},
        "spec": {"vocab_size": 8},
    }
    if run_id is not None:
        marker["run_id"] = run_id
    layout.publish(staging, root / layout.step_dir_name(step), marker)


def _tree(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what "untouched" is checked against."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_only_published_checkpoints_with_all_files_count(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 3)
    root = layout.checkpoints_dir(tmp_path)
    layout.prepare_staging(root, "step_000007")  # a save killed half-way: not a checkpoint
    assert [c.step for c in layout.complete_checkpoints(tmp_path)] == [1, 3]
    assert layout.latest_checkpoint(tmp_path).step == 3
    assert [p.name for p in layout.scan_checkpoints(tmp_path).staging] == [".tmp-step_000007"]
    (root / "step_000009").mkdir()  # no marker: a foreign or broken folder
    with pytest.raises(CheckpointError, match="no megarl_checkpoint.json"):
        layout.read_checkpoint(root / "step_000009")
    with pytest.raises(CheckpointError, match="no such directory"):
        layout.read_checkpoint(tmp_path / "absent")
    (root / "step_000003" / SHARD).unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        layout.read_checkpoint(root / "step_000003")
    assert [d.step for d in layout.scan_checkpoints(tmp_path).damaged] == [3, 9]


@pytest.mark.parametrize("recorded_sizes", [True, False])
def test_a_truncated_shard_is_damaged_with_or_without_recorded_sizes(tmp_path, recorded_sizes):
    _save(tmp_path, 1)
    path = layout.checkpoints_dir(tmp_path) / "step_000001"
    if not recorded_sizes:  # a checkpoint saved before sizes were recorded: the header tells
        marker = json.loads((path / layout.MARKER).read_text())
        del marker["sizes"]
        (path / layout.MARKER).write_text(json.dumps(marker))
    (path / SHARD).write_bytes(safetensors_bytes()[:-3])
    with pytest.raises(CheckpointError, match=f"{SHARD} is damaged"):
        layout.read_checkpoint(path)


def test_file_problem_reads_headers_only(tmp_path):
    good = tmp_path / "a.safetensors"
    good.write_bytes(safetensors_bytes())
    assert layout.file_problem(good) is None
    good.write_bytes(safetensors_bytes() + b"junk")
    assert "its tensors need" in layout.file_problem(good)
    (tmp_path / "b.json").write_text('{"stream": ')
    assert "not valid JSON" in layout.file_problem(tmp_path / "b.json")
    (tmp_path / "c.pt").write_bytes(b"PK\x03\x04 cut")
    assert "torch.save" in layout.file_problem(tmp_path / "c.pt")
    (tmp_path / "d.txt").write_text("abc")
    assert (
        layout.file_problem(tmp_path / "d.txt", expected_size=5) == "3 bytes, the marker recorded 5"
    )


def test_latest_refuses_to_skip_a_damaged_newest_checkpoint(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    root = layout.checkpoints_dir(tmp_path)
    (root / "step_000002" / SHARD).write_bytes(b"x")
    before = _tree(root)
    with pytest.raises(DamagedCheckpointError) as err:
        layout.latest_checkpoint(tmp_path)
    assert err.value.path == root / "step_000002"
    assert err.value.older is not None and err.value.older.step == 1
    assert _tree(root) == before
    (root / "step_000001" / SHARD).write_bytes(b"x")
    with pytest.raises(DamagedCheckpointError) as err:
        layout.latest_checkpoint(tmp_path)
    assert err.value.older is None


def test_publish_sets_an_existing_step_aside_and_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 2, 3, 4):
        _save(tmp_path, step)
    root = layout.checkpoints_dir(tmp_path)
    layout.prepare_staging(root, "step_000005")
    removed = layout.prune(tmp_path, keep_last=2, own_run_id=RUN)
    assert [p.name for p in removed] == ["step_000001", "step_000002"]
    names = sorted(p.name for p in root.iterdir())
    assert names[:2] == [".tmp-step_000005", "replaced-" + names[1].split("-", 1)[1]]
    assert names[1].endswith("-step_000002") and names[2:] == ["step_000003", "step_000004"]


def test_prune_removes_only_this_runs_complete_checkpoints(tmp_path):
    _save(tmp_path, 1, run_id=None)  # saved before run ids were recorded
    _save(tmp_path, 2, run_id="another-run")  # copied in from another run directory
    for step in (3, 4, 5, 6):
        _save(tmp_path, step)
    root = layout.checkpoints_dir(tmp_path)
    (root / "step_000004" / SHARD).write_bytes(b"x")  # damaged: never removed
    (root / ".del-step_000000").mkdir()  # a removal cut by a kill: left alone
    removed = layout.prune(tmp_path, keep_last=1, own_run_id=RUN)
    assert [p.name for p in removed] == ["step_000003", "step_000005"]
    assert sorted(p.name for p in root.iterdir()) == [
        ".del-step_000000",
        "step_000001",
        "step_000002",
        "step_000004",
        "step_000006",
    ]


def test_prune_never_removes_the_newest_complete_checkpoint(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    scan = layout.scan_checkpoints(tmp_path)
    assert [i.step for i in layout.prunable(scan, keep_last=0, own_run_id=RUN)] == [1]


def test_run_id_is_created_once(tmp_path):
    first = layout.run_id(tmp_path)
    assert layout.run_id(tmp_path) == first and len(first) == 32


def test_truncate_metrics_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in (1, 2, 3, 2, 4)]
    path.write_text("\n".join(rows) + '\n{"step": 5, "x"')
    cut = layout.truncate_metrics(path, 2)
    assert cut == layout.MetricsCut(kept=2, later=2, torn=1, duplicates=1)
    assert [r["step"] for r in layout.read_metrics(path)] == [1, 2]
    assert layout.read_metrics(path)[1]["x"] == 2
    assert path.read_text().endswith("}\n")


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
    assert diff.errors == (  # the model's own fields first: they say the most
        "model vocab_size: 8 -> 9",
        "model.hf_config: hidden_size 8 -> 16",
        "trainer.seed: 1 -> 2",
    )
    assert diff.changes == (
        "actor.lr: 1.0 -> 2.0",
        "actor.tp: 2 -> 1",
        "trainer.total_steps: 3 -> 6",
    )


def test_a_different_model_is_named_by_its_differing_fields_in_a_short_line():
    """Another model's whole ``hf_config`` (dozens of entries) is not printed: the entries
    that differ, at most three, and how many more."""
    llama = {f"key{i}": i for i in range(40)} | {"model_type": "llama", "num_hidden_layers": 4}
    qwen3 = {**llama, "model_type": "qwen3", "num_hidden_layers": 2, "head_dim": 32, "key7": 0}
    diff = compare_configs(
        {"model": {"hf_config": llama}},
        {"model": {"hf_config": qwen3}},
        {"family": "llama"},
        {"family": "qwen3"},
    )
    assert diff.errors == (
        "model family: 'llama' -> 'qwen3'",
        (
            "model.hf_config: head_dim None -> 32, key7 7 -> 0, model_type 'llama' -> 'qwen3' "
            "and 1 more"
        ),
    )
    none = compare_configs({"model": {"hf_config": None}}, {"model": {"hf_config": llama}})
    assert none.errors == ("model.hf_config: None -> {42 entries}",)


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
    root = layout.checkpoints_dir(tmp_path)
    (root / "step_000003" / SHARD).write_bytes(b"x")  # damaged ones are set aside too
    layout.prepare_staging(root, "step_000004")
    [staged] = layout.set_aside_staging(tmp_path)
    assert staged.name.startswith("incomplete-") and staged.name.endswith("-step_000004")
    moved = layout.set_aside_later(tmp_path, 1)
    assert sorted(p.name.split("-")[-1] for p in moved) == ["step_000002", "step_000003"]
    assert (moved[-1] / SHARD).read_bytes() == b"x"
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


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"step": "2"}, "has step '2', not a step number"),
        ({"step": 3}, "says step 3, the folder name says 1"),
        ({"layout": {"tp": 0, "pp": 1}}, "layout.tp 0"),
        ({"files": "model"}, "files entry"),
    ],
)
def test_a_marker_with_unusable_fields_is_one_line(tmp_path, edit, needle):
    _save(tmp_path, 1)
    path = layout.checkpoints_dir(tmp_path) / "step_000001"
    marker = json.loads((path / layout.MARKER).read_text())
    (path / layout.MARKER).write_text(json.dumps({**marker, **edit}))
    with pytest.raises(CheckpointError, match=needle) as err:
        layout.read_checkpoint(path)
    assert err.value.exit_code == 2

"""Which checkpoint a run resumes from, on plain folders: refusals leave the run directory as it
was, and what a resume or a fresh start sets aside is renamed and printed, never deleted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from test_checkpoint_layout import SHARD, _save, _tree

from megarl.checkpoint import layout
from megarl.checkpoint.layout import CheckpointError
from megarl.checkpoint.resume import RunChecks, prepare_resume
from megarl.data.loader import PromptStream


@dataclass(frozen=True)
class _Trainer:
    run_dir: str
    resume: str = "auto"
    seed: int = 1
    total_steps: int = 3
    save_interval: int = 1


@dataclass(frozen=True)
class _Cfg:
    trainer: _Trainer
    extra: dict = field(default_factory=dict)


def _cfg(run_dir, resume="auto") -> _Cfg:
    return _Cfg(_Trainer(str(run_dir), resume))


def _checks(**kwargs) -> RunChecks:
    return RunChecks(model_spec=lambda: {"vocab_size": 8}, **kwargs)


def _run_dir(tmp_path, steps=(1, 2), metrics_steps=(1, 2, 3)):
    """A run directory with checkpoints of ``steps`` and metrics lines of ``metrics_steps``."""
    for step in steps:
        _save(tmp_path, step)
        ckpt = layout.checkpoints_dir(tmp_path) / layout.step_dir_name(step)
        (ckpt / layout.HOST_STATE_FILE).write_text(
            json.dumps({"stream": {"epoch": 0, "position": 2 * step, "num_problems": 5, "seed": 1}})
        )
    lines = "".join(json.dumps({"step": s}) + "\n" for s in metrics_steps)
    (tmp_path / "metrics.jsonl").write_text(lines)
    return tmp_path


def test_auto_with_a_damaged_newest_checkpoint_stops_and_names_the_ways_on(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    root = layout.checkpoints_dir(run_dir)
    shard = root / "step_000002" / SHARD
    shard.write_bytes(shard.read_bytes()[:10])
    before = _tree(run_dir)
    with pytest.raises(CheckpointError) as err:
        prepare_resume(_cfg(run_dir), _checks())
    message = str(err.value)
    assert "\n" not in message
    assert f"checkpoint {root / 'step_000002'}: {SHARD} is damaged" in message
    assert f"trainer.resume={root / 'step_000001'}" in message
    assert "trainer.resume=never" in message
    assert _tree(run_dir) == before
    assert capsys.readouterr().out == ""


def test_auto_with_only_damaged_checkpoints_does_not_start_fresh(tmp_path):
    run_dir = _run_dir(tmp_path, steps=(1,))
    (layout.checkpoints_dir(run_dir) / "step_000001" / layout.MARKER).write_text("{")
    before = _tree(run_dir)
    with pytest.raises(CheckpointError, match="unreadable megarl_checkpoint.json.*resume=never"):
        prepare_resume(_cfg(run_dir), _checks())
    assert _tree(run_dir) == before


def test_resume_from_the_older_checkpoint_sets_the_damaged_one_aside(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    root = layout.checkpoints_dir(run_dir)
    (root / "step_000002" / SHARD).write_bytes(b"x")
    layout.prepare_staging(root, "step_000003")
    older = str(root / "step_000001")
    assert prepare_resume(_cfg(run_dir, resume=older), _checks()) == older
    out = capsys.readouterr().out
    assert "later checkpoints set aside: abandoned-" in out and "unfinished saves set aside" in out
    [abandoned] = root.glob("abandoned-*-step_000002")
    assert (abandoned / SHARD).read_bytes() == b"x"
    assert [p.name for p in root.glob("incomplete-*-step_000003")] != []
    assert [r["step"] for r in layout.read_metrics(run_dir / "metrics.jsonl")] == [1]


def test_metrics_after_a_resume_hold_each_step_once_and_torn_lines_are_reported(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, metrics_steps=(1, 2, 3))
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "actor/pg')
    prepare_resume(_cfg(run_dir), _checks())
    assert "dropped 1 torn line(s)" in capsys.readouterr().out
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_never_sets_every_checkpoint_and_the_metrics_aside(tmp_path, capsys):
    run_dir = _run_dir(tmp_path)
    (layout.checkpoints_dir(run_dir) / "step_000002" / SHARD).write_bytes(b"x")
    before = sorted(_tree(run_dir).values())
    assert prepare_resume(_cfg(run_dir, resume="never"), _checks()) is None
    assert "starting fresh" in capsys.readouterr().out
    assert layout.scan_checkpoints(run_dir) == layout.CheckpointScan((), (), ())
    assert not (run_dir / "metrics.jsonl").exists()
    assert sorted(_tree(run_dir).values()) == before  # the same bytes, under other names


def _stream_loader(num_problems: int):
    def load(state) -> None:
        PromptStream([object()] * num_problems, 1, seed=1).load_state_dict(state)

    return load


def test_a_data_position_beyond_the_dataset_is_refused_before_anything_changes(tmp_path):
    run_dir = _run_dir(tmp_path)
    assert prepare_resume(_cfg(run_dir), _checks(load_position=_stream_loader(5)))
    run_dir = _run_dir(tmp_path / "b")
    before = _tree(run_dir)
    with pytest.raises(CheckpointError, match="data position does not fit.*num_problems=5"):
        prepare_resume(_cfg(run_dir), _checks(load_position=_stream_loader(3)))
    assert _tree(run_dir) == before
    driver = layout.checkpoints_dir(run_dir) / "step_000002" / layout.HOST_STATE_FILE
    driver.write_text(json.dumps({"stream": {"epoch": 0, "position": 9, "seed": 1}}))
    with pytest.raises(CheckpointError, match="position 9 beyond the 5 problems"):
        prepare_resume(_cfg(run_dir), _checks(load_position=_stream_loader(5)))


def test_a_different_tokenizer_vocabulary_is_refused(tmp_path):
    run_dir = _run_dir(tmp_path)
    ckpt = layout.checkpoints_dir(run_dir) / "step_000002"
    model = tmp_path / "model"
    model.mkdir()
    vocab = {"model": {"vocab": {"a": 0, "b": 1}, "merges": []}, "added_tokens": []}
    (ckpt / "tokenizer.json").write_text(json.dumps(vocab))
    (model / "tokenizer.json").write_text(json.dumps(vocab, indent=2))  # formatting only
    assert prepare_resume(_cfg(run_dir), _checks(model_dir=str(model))) is not None
    run_dir = _run_dir(tmp_path / "b")
    ckpt = layout.checkpoints_dir(run_dir) / "step_000002"
    (ckpt / "tokenizer.json").write_text(json.dumps(vocab))
    vocab["model"]["vocab"] = {"a": 1, "b": 0}
    (model / "tokenizer.json").write_text(json.dumps(vocab))
    before = _tree(run_dir)
    with pytest.raises(CheckpointError, match="tokenizer vocabulary in tokenizer.json differs"):
        prepare_resume(_cfg(run_dir), _checks(model_dir=str(model)))
    assert _tree(run_dir) == before

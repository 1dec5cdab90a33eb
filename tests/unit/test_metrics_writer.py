"""metrics.jsonl and TensorBoard after a resume: each step shows once, with the resumed values."""

from __future__ import annotations

import json

import pytest

from megarl.trainer.metrics import MetricsWriter


def _write(run_dir, steps, value_offset):
    writer = MetricsWriter(run_dir, tensorboard=True)
    for step in steps:
        writer.write({"step": step, "actor/pg_loss": step + value_offset})
    writer.close()


def test_tensorboard_hides_the_interrupted_runs_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(tmp_path, [1, 2, 3, 4], value_offset=0.0)  # interrupted after step 4
    _write(tmp_path, [3, 4, 5], value_offset=0.5)  # resumed from the step-2 checkpoint
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("actor/pg_loss")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5), (5, 5.5)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 3, 4, 5]  # resume.py cuts this file itself


def test_a_torn_last_line_is_cut_with_a_warning_and_appending_continues(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "actor/pg')  # killed in the middle of a write
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 2, "actor/pg_loss": 0.5})
    writer.close()
    assert "dropped a torn last line (21 bytes" in capsys.readouterr().err
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1}, {"step": 2, "actor/pg_loss": 0.5}]


def test_a_file_of_whole_lines_is_left_as_it_is(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    MetricsWriter(tmp_path, tensorboard=False).close()
    assert path.read_text() == '{"step": 1}\n' and capsys.readouterr().err == ""
    path.write_text('{"st')  # a torn first line: nothing complete to keep
    MetricsWriter(tmp_path, tensorboard=False).close()
    assert path.read_text() == ""


def test_a_fresh_start_sets_the_old_events_aside_instead_of_mixing_them_in(tmp_path, capsys):
    """resume=never: the old run went to step 4, the new one to step 2. Its curve holds only its
    own two points (purge_step alone would leave the old steps 3 and 4 on it); the old events
    are kept, byte for byte, in tensorboard.<time>, and the move is printed."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megarl.checkpoint.resume import RunChecks, prepare_resume
    from megarl.config.schema import RunConfig
    from megarl.config.trainer import TrainerConfig

    _write(tmp_path, [1, 2, 3, 4], value_offset=0.0)
    old_events = {p.name: p.read_bytes() for p in (tmp_path / "tensorboard").iterdir()}
    cfg = RunConfig(trainer=TrainerConfig(run_dir=str(tmp_path), resume="never"))
    assert prepare_resume(cfg, RunChecks(model_spec=dict)) is None
    [aside] = tmp_path.glob("tensorboard.*")
    said = capsys.readouterr().out
    assert "set aside: metrics." in said and f".jsonl, {aside.name}" in said, said
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == old_events
    _write(tmp_path, [1, 2], value_offset=0.5)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 1.5), (2, 2.5)]


def test_the_initial_validation_has_a_console_line_of_its_own():
    from megarl.trainer.metrics import validation_line

    record = {
        "step": 0,
        "val-core/gsm8k/reward/mean@1": 0.25,
        "val-core/math/reward/mean@1": 0.5,
        "val-aux/response_length/mean": 9.0,
        "timing_s/testing": 3.04,
    }
    assert validation_line(record) == "step   0 | validation: gsm8k 0.250, math 0.500 | 3.0s"

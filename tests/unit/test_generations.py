"""Generations dumps: the records, and that a step file is never written over another file."""

from __future__ import annotations

import json

import pytest

from megarl.config.schema import RunConfig
from megarl.config.trainer import TrainerConfig
from megarl.train import StartupError, check_dump_dirs
from megarl.trainer.generations import (
    conflicting_step_files,
    rollout_records,
    step_file_steps,
    validation_records,
    write_step_file,
)


def test_step_files_are_the_numbered_jsonl_names():
    names = [
        "3.jsonl",
        "10.jsonl",
        "0.jsonl",
        "notes.jsonl",
        "2.json",
        ".4.jsonl.7.tmp",
        "x5.jsonl",
    ]
    assert step_file_steps(names) == [0, 3, 10]


def test_conflicts_are_the_files_of_steps_the_run_will_write(tmp_path):
    assert conflicting_step_files(tmp_path / "missing", 1) == []
    for name in ("0.jsonl", "1.jsonl", "2.jsonl", "5.jsonl", "README.md"):
        (tmp_path / name).write_text("")
    assert conflicting_step_files(tmp_path, 1) == ["1.jsonl", "2.jsonl", "5.jsonl"]
    assert conflicting_step_files(tmp_path, 3) == ["5.jsonl"]  # a resume from step 2
    assert conflicting_step_files(tmp_path, 6, step_zero=True) == ["0.jsonl"]


def test_rollout_records_say_which_sequences_were_trained():
    texts = [("1+1?", "2", "2"), ("1+1?", "3", "2"), ("2+2?", "4", "4"), ("2+2?", "4", "4")]
    records = rollout_records(
        7, texts, [1.0, 0.0, 1.0, 1.0], [0.7, -0.7, 0.0, 0.0], [0, 0, 1, 1], trained=(1, 0)
    )
    assert records[1] == {
        "step": 7,
        "group": 0,
        "prompt": "1+1?",
        "response": "3",
        "answer": "2",
        "reward": 0.0,
        "advantage": -0.7,
        "trained": True,
    }
    assert [r["trained"] for r in records] == [True, True, False, False]


def test_validation_records_name_the_data_source():
    [record] = validation_records(0, [""], [("q", "r", "a")], [0.5])
    assert record == {
        "step": 0,
        "data_source": "unknown",
        "prompt": "q",
        "response": "r",
        "answer": "a",
        "reward": 0.5,
    }


def test_a_step_file_is_written_whole_and_never_over_another(tmp_path, capsys):
    folder = tmp_path / "dump"
    written = write_step_file(folder, 3, [{"a": "é"}, {"a": 2}])
    assert written == folder / "3.jsonl"
    assert [json.loads(line) for line in written.read_text().splitlines()] == [{"a": "é"}, {"a": 2}]
    before = written.read_bytes()
    assert write_step_file(folder, 3, [{"a": "other run"}]) is None
    assert written.read_bytes() == before
    assert "3.jsonl exists (written by another run)" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["3.jsonl"]  # no temporary file left


def _cfg(tmp_path, **trainer) -> RunConfig:
    return RunConfig(trainer=TrainerConfig(run_dir=str(tmp_path / "run"), **trainer))


def test_start_up_refuses_a_folder_holding_steps_this_run_writes(tmp_path):
    dump = tmp_path / "gens"
    dump.mkdir()
    (dump / "notes.txt").write_text("keep")
    check_dump_dirs(_cfg(tmp_path, rollout_data_dir=str(dump)))  # nothing of a step
    for step in (1, 2, 3, 4):
        (dump / f"{step}.jsonl").write_text("{}\n")
    with pytest.raises(StartupError) as info:
        check_dump_dirs(_cfg(tmp_path, rollout_data_dir=str(dump)))
    assert str(info.value) == (
        f"trainer.rollout_data_dir={dump}: 1.jsonl, 2.jsonl, 3.jsonl and 1 more already exist "
        "(this run writes steps 1 onwards and never overwrites a file); move them or choose "
        "another folder"
    )
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match=r"validation_data_dir=.*file: exists and is not a"):
        check_dump_dirs(_cfg(tmp_path, validation_data_dir=str(tmp_path / "file")))
    assert (dump / "notes.txt").read_text() == "keep"

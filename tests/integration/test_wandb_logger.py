"""``trainer.logger=[..., wandb]``: what reaches wandb, read back from its offline run files.

wandb runs offline here (``WANDB_MODE=offline``, every wandb folder in the test's tmp dir, no
network); its service process is a child of the process that logs and exits with it.
"""

from __future__ import annotations

import json

import pytest
from helpers.runs import tiny_overrides
from wandb_records import offline_runs

from megarl.trainer.metrics import MetricsWriter, WandbRun, new_wandb_run_id

pytest.importorskip("wandb")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb offline and silent, every folder it writes under ``tmp_path/wandb-home``."""
    home = tmp_path / "wandb-home"
    home.mkdir()
    for key in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    return home


def _wandb_run(tmp_path, run_id: str) -> WandbRun:
    return WandbRun("proj", "exp", run_id, {"trainer": {"seed": 7}}, tmp_path)


def test_one_wandb_step_per_training_step_with_the_config(tmp_path, wandb_offline):
    writer = MetricsWriter(tmp_path / "run", tensorboard=False, wandb=_wandb_run(tmp_path, "r1"))
    for step in (1, 2, 3):
        writer.write({"step": step, "actor/pg_loss": step / 10, "planner/summary": "text"})
    writer.close()
    [run] = offline_runs(wandb_offline)
    assert (run.run_id, run.project, run.name, run.finished) == ("r1", "proj", "exp", True)
    assert run.config["trainer"] == {"seed": 7}
    assert [(h["_step"], h["actor/pg_loss"]) for h in run.history] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert all("planner/summary" not in h for h in run.history)  # numbers only, as TensorBoard
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_a_saved_run_id_is_continued_and_must_come_before_the_first_step(tmp_path, wandb_offline):
    first = MetricsWriter(tmp_path, tensorboard=False, wandb=_wandb_run(tmp_path, "a1"))
    first.write({"step": 1, "x": 1.0})
    with pytest.raises(RuntimeError, match="already started"):
        first.continue_wandb_run("zz")
    first.close()
    resumed = MetricsWriter(tmp_path, tensorboard=False, wandb=_wandb_run(tmp_path, "b2"))
    resumed.continue_wandb_run(first.wandb_run_id or "")
    resumed.write({"step": 2, "x": 2.0})
    resumed.close()
    runs = offline_runs(wandb_offline)
    assert [r.run_id for r in runs] == ["a1", "a1"]
    assert [[h["_step"] for h in r.history] for r in runs] == [[1], [2]]


def test_without_wandb_or_jsonl_nothing_of_theirs_is_written(tmp_path, wandb_offline):
    writer = MetricsWriter(tmp_path / "run", tensorboard=False, jsonl=False)
    writer.write({"step": 1, "x": 1.0})
    writer.close()
    assert writer.wandb_run_id is None
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not list(wandb_offline.iterdir())


def test_fresh_ids_differ():
    ids = {new_wandb_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 8 and i.isalnum() and i.islower() for i in ids)


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_start_gets_a_new_one(
    tmp_path, wandb_offline
):
    """Two ranks first (rank 0 is a spawned process that ends with ``os._exit``: its wandb files
    must still be complete), then a resume at one rank, then ``trainer.resume=never``."""
    from megarl.checkpoint.layout import HOST_STATE_FILE, complete_checkpoints
    from megarl.train import run

    run_dir = tmp_path / "exp7"
    common = {
        "trainer.logger": "[jsonl,wandb]",
        "trainer.project_name": "proj",
        "trainer.save_interval": 2,
    }
    run(tiny_overrides(run_dir, 2, **common, **{"trainer.n_gpus_per_node": 2}))
    [checkpoint] = complete_checkpoints(run_dir)
    saved = json.loads((checkpoint.path / HOST_STATE_FILE).read_text())
    run(tiny_overrides(run_dir, 3, **common))
    run(tiny_overrides(run_dir, 1, **common, **{"trainer.resume": "never"}))

    first, resumed, fresh = offline_runs(wandb_offline)
    assert first.run_id == saved["wandb_run_id"] == resumed.run_id != fresh.run_id
    assert [[h["_step"] for h in r.history] for r in (first, resumed, fresh)] == [[1, 2], [3], [1]]
    assert all(r.finished and r.project == "proj" and r.name == "exp7" for r in (first, fresh))
    assert first.config["trainer"]["logger"] == ["jsonl", "wandb"]
    assert (
        first.config["trainer"]["total_steps"] == 2
        and resumed.config["trainer"]["total_steps"] == 3
    )
    [aside] = run_dir.glob("metrics.*.jsonl")  # the fresh start set steps 1-3 aside
    for path, logged in (
        (aside, first.history + resumed.history),
        (run_dir / "metrics.jsonl", fresh.history),
    ):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == len(logged)
        for row, values in zip(rows, logged, strict=True):
            assert values["_step"] == row["step"]
            assert values["actor/pg_loss"] == row["actor/pg_loss"]
            assert values["critic/rewards/mean"] == row["critic/rewards/mean"]


def test_start_opens_the_run_before_any_step(tmp_path, wandb_offline):
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb=_wandb_run(tmp_path, "s1"))
    writer.start()
    with pytest.raises(RuntimeError, match="already started"):  # a saved id would come too late
        writer.continue_wandb_run("zz")
    writer.close()
    [run] = offline_runs(wandb_offline)
    assert (run.run_id, run.history, run.finished) == ("s1", [], True)
    assert run.config["trainer"] == {"seed": 7}

"""Asynchronous training end to end: the Megatron trainer, the rollout actor (split placement,
Ray), the tiny model on CPU, per-request seeds.

* ``fully_async`` at ``max_staleness=0`` trains bitwise like the synchronous loop: the same
  prompts in the same order, rewards, losses, grad norms and final weights; stopped after a
  checkpoint and resumed, still bitwise.
* ``one_step_off`` trains bitwise like a synchronous loop whose batch t is generated with the
  weights after step t - 2 (the oracle: the synchronous run with an engine that applies each
  pushed version one step late, and the correction the asynchronous mode turns on).
* ``fully_async`` with ``max_staleness=2`` and partial rollouts, killed after a checkpoint while
  groups of later steps were buffered and resumed: every step trains the prompts the synchronous
  loop trains at that step, once, and no token is older than the bound.
* A rollout side that stops producing fails the run within the collective timeout, naming the
  rollout actor and what it was doing.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import metrics_rows, one_ray, tiny_overrides  # noqa: F401 - one_ray: autouse

from megarl.distributed.launcher import WorkerFailed
from megarl.train import run

pytestmark = pytest.mark.slow

SPLIT = {"trainer.launcher": "ray", "rollout.n_gpus": 1}
VOLATILE = ("timing_s/", "perf/", "async/")


def _assert_same_training(a_rows, b_rows, a_state, b_state) -> None:
    """Every metric but timings equal, and the final weights bitwise."""
    assert len(a_rows) == len(b_rows)
    for a, b in zip(a_rows, b_rows, strict=True):
        for key, value in a.items():
            if not key.startswith(VOLATILE) and key in b:
                assert value == b[key], (a["step"], key, value, b[key])
    assert sorted(a_state) == sorted(b_state)
    for name, tensor in a_state.items():
        assert torch.equal(tensor, b_state[name]), name


def _sync_and_zero_stalenessmetrics_rows(tmp_path, settings: dict) -> tuple[list[dict], list[dict]]:
    """Two steps of ``settings`` in the synchronous loop and in ``fully_async`` at staleness 0,
    checked to train bitwise alike; their metrics rows."""
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync = run(tiny_overrides(sync_dir, 2, **settings), return_final_state=True)
    zero = {**settings, "async_training.mode": "fully_async", "async_training.max_staleness": 0}
    fully_async = run(tiny_overrides(async_dir, 2, **zero), return_final_state=True)
    sync_rows, async_rows = metrics_rows(sync_dir), metrics_rows(async_dir)
    _assert_same_training(sync_rows, async_rows, sync.final_state, fully_async.final_state)
    return sync_rows, async_rows


def _prompts_by_step(dump_dir) -> dict[int, list[str]]:
    return {
        int(path.stem): [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
        for path in sorted(dump_dir.glob("*.jsonl"))
    }


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The synchronous loop, split placement, 4 steps: the reference."""
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    dump = run_dir.parent / "dump"
    result = run(
        tiny_overrides(run_dir, 4, **SPLIT, **{"trainer.rollout_data_dir": str(dump)}),
        return_final_state=True,
    )
    return metrics_rows(run_dir), result.final_state, _prompts_by_step(dump)


def test_fully_async_at_zero_staleness_trains_and_resumes_bitwise_like_sync(sync_run, tmp_path):
    rows, state, _ = sync_run
    run_dir = tmp_path / "run"
    settings = {
        **SPLIT,
        "async_training.mode": "fully_async",
        "async_training.max_staleness": 0,
        "trainer.save_interval": 2,
    }
    run(tiny_overrides(run_dir, 2, **settings))
    resumed = run(tiny_overrides(run_dir, 4, **settings), return_final_state=True)
    async_rows = metrics_rows(run_dir)
    _assert_same_training(rows, async_rows, state, resumed.final_state)
    assert all(r["async/staleness/max"] == 0.0 for r in async_rows)
    assert all("train forward (on-policy)" in r["gates/summary"] for r in async_rows)


def test_one_step_off_trains_bitwise_like_generating_batch_t_with_version_t_minus_2(
    tmp_path, monkeypatch
):
    steps = 3
    oracle_dir, async_dir = tmp_path / "oracle", tmp_path / "async"
    result = run(
        tiny_overrides(async_dir, steps, **SPLIT, **{"async_training.mode": "one_step_off"}),
        return_final_state=True,
    )
    _lag_engine_one_version(monkeypatch)
    # one thread, as the split run's rank and rollout actor each have one core of their own
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    correction = {"algo.rollout_correction.rollout_is": "token"}  # what one_step_off turns on
    oracle = run(tiny_overrides(oracle_dir, steps, **correction), return_final_state=True)
    async_rows = metrics_rows(async_dir)
    _assert_same_training(
        metrics_rows(oracle_dir), async_rows, oracle.final_state, result.final_state
    )
    assert [r["async/staleness/max"] for r in async_rows] == [0.0, 1.0, 1.0]
    assert (
        "old_lp: train forward (proximal; behaviour version 0 < trainer 1)"
        in (async_rows[1]["gates/summary"])
    )
    assert async_rows[1]["timing_s/old_log_prob"] == 0.0  # the training forward is the proximal


def _lag_engine_one_version(monkeypatch) -> None:
    """The oracle's engine (a one-process run builds it in this process): each weight sync
    applies the weights of the sync before it, and the batch says so in its versions."""
    from megarl.trainer import rollout_host

    class LaggingEngine:
        def __init__(self, engine) -> None:
            self.engine, self.held = engine, None

        def __getattr__(self, name):
            return getattr(self.engine, name)

        def update_weights(self, named_tensors, record_checksums=False):
            received = [(name, tensor.clone()) for name, tensor in named_tensors]
            if self.held is not None:
                self.engine.update_weights(self.held, record_checksums)
            self.held = received
            return len(received)

    build = rollout_host.build_run_engine

    def lagging(*args):
        engine, sleep_level = build(*args)
        return LaggingEngine(engine), sleep_level

    monkeypatch.setattr(rollout_host, "build_run_engine", lagging)
    monkeypatch.setattr(
        rollout_host.RolloutHost,
        "weights_loaded",
        lambda self, version: setattr(self, "weights_version", max(version - 1, 0)),
    )


def test_fully_async_killed_after_a_checkpoint_resumes_every_prompt_once(
    sync_run, tmp_path, monkeypatch
):
    _, _, sync_prompts = sync_run
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    settings = {
        **SPLIT,
        "async_training.mode": "fully_async",
        "async_training.max_staleness": 2,
        "async_training.partial_rollout": True,
        "trainer.save_interval": 2,
        "trainer.rollout_data_dir": str(dump),
    }
    with monkeypatch.context() as killed:
        killed.setenv("MEGARL_FAULT_INJECT", "0:4")  # rank 0 dies as step 4 starts
        with pytest.raises(WorkerFailed):
            run(tiny_overrides(run_dir, 4, **settings))
    assert [r["step"] for r in metrics_rows(run_dir)] == [1, 2, 3]
    # the resume sets step 3's dump (written after the checkpoint) aside and trains 3 and 4 again
    (dump / "3.jsonl").rename(tmp_path / "3.jsonl.before")
    run(tiny_overrides(run_dir, 4, **settings))
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _prompts_by_step(dump) == sync_prompts  # the same prompts at every step, once
    assert all(r["async/staleness/max"] <= 2 for r in rows)


@pytest.mark.serial  # the stall is found within seconds
def test_a_stuck_rollout_side_fails_the_run_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_FAULT_FREEZE", "rollout:2")
    settings = {
        **SPLIT,
        "async_training.mode": "one_step_off",
        "trainer.collective_timeout_s": 8,
    }
    with pytest.raises(WorkerFailed) as failed:
        run(tiny_overrides(tmp_path / "run", 3, **settings))
    message = str(failed.value)
    assert "rollout actor on node" in message, message
    assert "no batch for step 2 within trainer.collective_timeout_s=8 s" in message, message
    assert "generating 8 sequences of step 2 under weights version 0" in message, message


def test_agent_loops_in_fully_async_at_zero_staleness_train_bitwise_like_sync(tmp_path):
    """The buffer holds whole trajectories (the documented two-turn loop, docs/agents.md): at staleness 0 the
    asynchronous rollout side builds the same trajectories, with the same seeds and masks, as
    the synchronous loop, so the training is bitwise the same."""
    loop = {
        **SPLIT,
        "rollout.agent.loop": "agent_loops:TwoTurns",
        "rollout.max_new_tokens": 40,
    }
    _, async_rows = _sync_and_zero_stalenessmetrics_rows(tmp_path, loop)
    for row in async_rows:
        assert row["agent/num_turns/mean"] == 2.0 and row["agent/observation_tokens/mean"] == 8.0
        assert row["rollout/logprob_abs_diff"] <= 1e-4


def test_gateway_sessions_in_fully_async_at_zero_staleness_train_bitwise_like_sync(tmp_path):
    """An unmodified openai-SDK agent that compacts its context (two branches per session):
    the rollout side runs the same sessions, seeds and branches as the synchronous loop, so the
    training is bitwise the same."""
    gateway = {
        **SPLIT,
        "rollout.agent.loop": "openai",
        "rollout.agent.entrypoint": "helpers.gateway_agents:compacting",
        "rollout.max_new_tokens": 24,
    }
    sync_rows, _ = _sync_and_zero_stalenessmetrics_rows(tmp_path, gateway)
    assert all(row["agent/branches/mean"] == 2.0 for row in sync_rows)


def test_gateway_sessions_under_partial_rollouts_complete_across_weight_syncs(tmp_path):
    """Requests interrupted by a weight sync complete transparently: every step trains two
    turns per session, no token older than the bound."""
    settings = {
        **SPLIT,
        "rollout.agent.loop": "openai",
        "rollout.agent.entrypoint": "helpers.gateway_agents:two_turns",
        "rollout.max_new_tokens": 40,
        "async_training.mode": "fully_async",
        "async_training.max_staleness": 1,
        "async_training.partial_rollout": True,
    }
    history = run(tiny_overrides(tmp_path / "run", 3, **settings)).history
    assert [row["step"] for row in history] == [1, 2, 3]
    for row in history:
        assert row["agent/num_turns/mean"] == 2.0
        assert row["async/staleness/max"] <= 1

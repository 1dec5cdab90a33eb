"""The Ray launcher's plain parts, without Ray: layout, the rank shell class, failure text."""

from __future__ import annotations

import pytest

from megarl.distributed import fault_injection
from megarl.distributed.launcher import WorkerContext, WorkerFailed, role_of
from megarl.distributed.ray_launcher import CPU_PER_RANK, RankActor, RayLayout


def _echo(ctx: WorkerContext, value):
    return (ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port, value)


def test_layout_cpu_two_nodes_is_spread_with_token_cpu():
    layout = RayLayout(nnodes=2, ranks_per_node=3, device="cpu")
    assert layout.world_size == 6
    assert layout.strategy() == "STRICT_SPREAD"
    assert layout.bundles() == [{"CPU": pytest.approx(3 * CPU_PER_RANK)}] * 2
    assert [layout.node_index(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert sum(layout.rank_resources()["CPU"] for _ in range(6)) < 1  # fits a 1-core node


def test_layout_gpu_one_node_packs_whole_gpus():
    layout = RayLayout(nnodes=1, ranks_per_node=8, device="cuda")
    assert layout.strategy() == "PACK"
    assert layout.bundles() == [{"CPU": 8.0, "GPU": 8.0}]
    assert layout.rank_resources()["GPU"] == 1.0


def test_rank_worker_runs_the_entry_point_and_forwards_env(monkeypatch):
    monkeypatch.delenv("MEGARL_TEST_FORWARD", raising=False)
    worker = RankActor(1, {"MEGARL_TEST_FORWARD": "yes"}, [])
    import os

    assert os.environ["MEGARL_TEST_FORWARD"] == "yes"
    ctx = WorkerContext(1, 2, "10.0.0.1", worker.free_port())
    assert worker.run(_echo, ctx, ("x",))[:3] == (1, 2, "10.0.0.1")
    placement = worker.placement()
    assert placement.rank == 1 and placement.role == "actor"
    assert "actor rank 1 on node" in placement.describe()
    monkeypatch.delenv("MEGARL_TEST_FORWARD")


def test_worker_failed_names_role_rank_and_node():
    assert role_of(0) == "actor+rollout"
    text = str(WorkerFailed(1, 137, "killed"))
    assert text.startswith("actor rank 1 on node ") and "exit code 137" in text
    where = "actor rank 3 on node gpu7 (10.0.0.7, ray node abcd1234, pid 42)"
    assert str(WorkerFailed(3, None, "the process died", where=where)) == (
        where + " failed: the process died"
    )


def test_fault_injection_only_fires_for_its_rank_and_step(monkeypatch):
    assert fault_injection.parse("1:2") == (1, 2)
    monkeypatch.setenv(fault_injection.ENV, "1:2")
    fault_injection.maybe_die(0, 2)  # other rank: returns
    fault_injection.maybe_die(1, 1)  # other step: returns
    monkeypatch.delenv(fault_injection.ENV)
    fault_injection.maybe_die(1, 2)  # unset: returns
    monkeypatch.setenv(fault_injection.RAISE_ENV, "1:2")
    fault_injection.maybe_raise(0, 2)  # other rank: returns
    with pytest.raises(fault_injection.InjectedError, match="rank 1 raises at step 2"):
        fault_injection.maybe_raise(1, 2)


def test_fault_injection_rollout_spec_fires_only_for_the_rollout_actor(monkeypatch):
    assert fault_injection.parse("rollout:2") == (fault_injection.ROLLOUT, 2)
    monkeypatch.setenv(fault_injection.ENV, "rollout:2")
    fault_injection.maybe_die(0, 2)  # a rank, even rank 0 that drives it: returns
    fault_injection.maybe_die(fault_injection.ROLLOUT, 1)  # other step: returns
    monkeypatch.setenv(fault_injection.ENV, "0:2")
    fault_injection.maybe_die(fault_injection.ROLLOUT, 2)  # a rank's spec: returns
    with pytest.raises(ValueError):
        fault_injection.parse("engine:2")


def test_side_actor_failure_names_the_actor_and_survives_pickling():
    import pickle

    from megarl.distributed.ray_launcher import ActorPlacement, SideActorFailed

    where = ActorPlacement(
        role="rollout", node_ip="10.0.0.9", hostname="gpu9", node_id="abcd1234ffff", pid=7
    ).describe()
    assert where == "rollout actor on node gpu9 (10.0.0.9, ray node abcd1234, pid 7)"
    failure = pickle.loads(pickle.dumps(SideActorFailed(where, "the process died during rollout")))
    assert (failure.where, failure.detail) == (where, "the process died during rollout")
    assert str(WorkerFailed(-1, None, failure.detail, where=failure.where)) == (
        where + " failed: the process died during rollout"
    )
    assert "rollout actor on node" in ActorPlacement.here("rollout").describe()  # outside Ray


def test_actor_death_text_is_cut_to_exit_type_and_detail():
    from megarl.distributed.ray_launcher import _death_cause

    ray_text = (
        "The actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
        "error code 2. End of file. Some common causes include: (1) the process was "
        "killed by the OOM killer ..."
    )
    assert _death_cause(RuntimeError(ray_text)) == (
        "the process died (killed, OOM or crashed: exit type SYSTEM_ERROR; Worker unexpectedly "
        "exits with a connection error code 2.)"
    )
    assert "no Python error" in _death_cause(RuntimeError("gone"))


def test_split_rollout_key_is_validated():
    from megarl.config.schema import ConfigError, build_run_config

    assert build_run_config({}).rollout.n_gpus == 0  # colocated by default
    cfg = build_run_config({"rollout": {"n_gpus": 2}, "trainer": {"launcher": "ray"}})
    assert cfg.rollout.n_gpus == 2
    with pytest.raises(ConfigError, match="rollout.n_gpus=1: a split rollout placement needs"):
        build_run_config({"rollout": {"n_gpus": 1}})
    with pytest.raises(ConfigError, match="rollout.n_gpus=-1"):
        build_run_config({"rollout": {"n_gpus": -1}, "trainer": {"launcher": "ray"}})


def test_side_actor_bundle_cpu_token_or_whole_gpus():
    from megarl.distributed.ray_launcher import SideActor

    side = SideActor(
        role="rollout", cls=object, init_args=(), n_gpus=2, attach=lambda handle, args: args
    )
    assert side.bundle("cuda") == {"CPU": 1.0, "GPU": 2.0}
    assert side.bundle("cpu") == {"CPU": CPU_PER_RANK}


def _side_actor_failure(monkeypatch, traceback: str, error: BaseException):
    """The :class:`SideActorFailed` a rollout-actor call whose remote side raised ``error``
    (with ``traceback``) gives the controller, after the pickling that carries it there."""
    import pickle

    import ray
    import ray.exceptions

    from megarl.distributed.ray_launcher import SideActorFailed, get_from_side_actor

    def raising_get(ref, timeout=None):
        raise ray.exceptions.RayTaskError("call", traceback, error)

    monkeypatch.setattr(ray, "get", raising_get)
    with pytest.raises(SideActorFailed) as info:
        get_from_side_actor(object(), "rollout actor on node n", "rollout")
    return pickle.loads(pickle.dumps(info.value))


def test_a_bad_input_error_in_the_rollout_actor_keeps_its_line_and_exit_2(monkeypatch):
    """A reward function failing in the split rollout actor: the one line and exit 2 reach the
    controller through the pickled SideActorFailed (no 'BadInputError:' prefix, no exit 1)."""
    from megarl.errors import BadInputError

    failure = _side_actor_failure(monkeypatch, "tb", BadInputError("data.reward=m:f: sample 0"))
    assert (failure.detail, failure.exit_code) == ("data.reward=m:f: sample 0 during rollout", 2)
    error = WorkerFailed(-1, None, failure.detail, where=failure.where, exit_code=failure.exit_code)
    assert error.exit_code == 2
    assert str(error) == "rollout actor on node n failed: data.reward=m:f: sample 0 during rollout"


def test_a_side_actor_call_that_never_answers_is_named_with_its_timeout(monkeypatch):
    """The asynchronous batch call waits with a timeout: no answer in time is the side actor's
    failure, naming the call, not a hang."""
    import ray

    from megarl.distributed.ray_launcher import SideActorFailed, get_from_side_actor

    def never_answering_get(ref, timeout=None):
        assert timeout == 12.5
        raise ray.exceptions.GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", never_answering_get)
    with pytest.raises(SideActorFailed) as info:
        get_from_side_actor(object(), "rollout actor on node n", "next_batch", timeout_s=12.5)
    assert (
        str(info.value)
        == "rollout actor on node n failed: no answer within 12.5 s during next_batch"
    )


def _placements() -> list:
    from megarl.distributed.ray_launcher import RankPlacement

    return [
        RankPlacement(
            rank, role_of(rank), f"10.0.0.{rank}", f"gpu{rank}", "abcd1234ffff", 40 + rank
        )
        for rank in range(2)
    ]


def _beat(folder, rank: int, phase: str, step: int, age_s: float) -> None:
    import json
    import time

    from megarl.distributed.heartbeat import Beat, beat_path

    beat_path(folder, rank).parent.mkdir(parents=True, exist_ok=True)
    beat = Beat(rank, f"gpu{rank}", 40 + rank, step, phase, time.time() - age_s)
    beat_path(folder, rank).write_text(json.dumps(beat.__dict__))


def _task_error(cause: BaseException):
    import ray.exceptions

    return ray.exceptions.RayTaskError(
        "RankActor.run", "Traceback (most recent call last):\n  in rank_loop.py\n", cause
    )


def test_a_ray_rank_that_raised_is_one_line_with_its_phase_and_a_logged_traceback(
    tmp_path, monkeypatch
):
    """Rank 1's code raised during update_actor of step 2: the line names its placement, error
    and phase (from its heartbeat); Ray's remote traceback goes to logs/error-rank1.txt."""
    import ray

    from megarl.config.schema import RunConfig
    from megarl.config.trainer import TrainerConfig
    from megarl.distributed.heartbeat import HeartbeatWatch
    from megarl.distributed.ray_launcher import _result_of
    from megarl.train import _tracebacks_to_log

    watch = HeartbeatWatch(str(tmp_path / ".heartbeat"), timeout_s=60)
    _beat(watch.folder, 1, "update_actor", 2, age_s=1)

    def raising_get(ref):
        raise _task_error(KeyError("no such column"))

    monkeypatch.setattr(ray, "get", raising_get)
    cfg = RunConfig(trainer=TrainerConfig(run_dir=str(tmp_path)))
    with pytest.raises(WorkerFailed) as failed, _tracebacks_to_log(cfg):
        _result_of(object(), 1, {}, _placements(), watch)
    log = tmp_path / "logs" / "error-rank1.txt"
    where = _placements()[1].describe()
    assert str(failed.value) == (
        f"{where} failed: KeyError: 'no such column' during update_actor of step 2 "
        f"(traceback: {log})"
    )
    assert "in rank_loop.py" in log.read_text()


def test_a_ray_rank_stuck_before_its_peers_timeout_is_named_not_the_peer(tmp_path, monkeypatch):
    """Rank 0's collective timed out waiting for rank 1, whose loop stopped 20 s ago during the
    rollout: the line names rank 1 (the local launcher's check and text), not rank 0's error."""
    import ray

    from megarl.distributed.heartbeat import HeartbeatWatch
    from megarl.distributed.ray_launcher import _result_of

    watch = HeartbeatWatch(str(tmp_path), timeout_s=10)
    _beat(tmp_path, 0, "broadcast_rollout", 2, age_s=11)
    _beat(tmp_path, 1, "rollout", 2, age_s=20)

    def raising_get(ref):
        raise _task_error(RuntimeError("Gloo timed out"))

    monkeypatch.setattr(ray, "get", raising_get)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: ([], refs))  # rank 1 lives on
    rank1_task = object()
    with pytest.raises(WorkerFailed) as failed:
        _result_of(object(), 0, {rank1_task: 1}, _placements(), watch)
    assert failed.value.rank == 1
    assert str(failed.value) == (
        f"{_placements()[1].describe()} failed: stopped responding: no progress for 20 s "
        "during rollout of step 2; then 1 other rank(s) failed"
    )
    _beat(tmp_path, 1, "rollout", 2, age_s=3)  # rank 1 was fine: rank 0's own error is named
    with pytest.raises(WorkerFailed) as failed:
        _result_of(object(), 0, {rank1_task: 1}, _placements(), watch)
    assert "actor+rollout rank 0" in str(failed.value)
    assert "RuntimeError: Gloo timed out during broadcast_rollout of step 2" in str(failed.value)


def test_a_stop_signal_inside_ray_calls_waits_for_the_next_check():
    """A handler raising inside one of Ray's Cython calls would surface as a SystemError blamed
    on a rank; deferred, it raises at the controller's next check, and handlers are restored."""
    import os
    import signal

    from megarl.distributed.launcher import RunStopped, stop_on_signals
    from megarl.distributed.ray_launcher import DeferredSignals

    reached = []

    def signal_then_check() -> None:
        with DeferredSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            reached.append("after the signal")
            signals.check()
            reached.append("after the check")

    with stop_on_signals():
        ours = signal.getsignal(signal.SIGTERM)
        with pytest.raises(RunStopped) as stopped:
            signal_then_check()
        assert reached == ["after the signal"]
        assert stopped.value.exit_code == 143
        assert signal.getsignal(signal.SIGTERM) is ours
        with pytest.raises(RunStopped), DeferredSignals():  # received during clean-up
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGTERM) is ours


def test_megarl_and_wandb_settings_travel_to_the_actors(monkeypatch):
    from megarl.distributed.ray_launcher import forwarded_env

    monkeypatch.setenv("MEGARL_COLLECTIVE_X", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NOT_FORWARDED_X", "1")
    env = forwarded_env()
    assert env["MEGARL_COLLECTIVE_X"] == "1" and env["WANDB_MODE"] == "offline"
    assert "NOT_FORWARDED_X" not in env


def test_a_driver_or_a_process_without_ray_is_no_ray_actor():
    from megarl.distributed.ray_launcher import in_ray_actor

    assert not in_ray_actor()


def test_an_unexpected_error_in_the_rollout_actor_keeps_its_traceback(monkeypatch):
    """A user agent loop raising in the split rollout actor (fully_async): the one line names
    the actor, and the remote traceback travels to the report (written to the run's log)."""
    import ray
    import ray.exceptions

    from megarl.distributed import ray_launcher

    failure = _side_actor_failure(monkeypatch, "Traceback: loops.py line 9", KeyError("x"))
    assert failure.detail == "KeyError: 'x' during rollout"
    assert "loops.py line 9" in failure.traceback

    def rank_task_raising(ref, timeout=None):
        raise ray.exceptions.RayTaskError("rank", "tb", failure)

    class Here:
        def describe(self):
            return "actor+rollout rank 0 on node n"

    monkeypatch.setattr(ray, "get", rank_task_raising)
    with pytest.raises(WorkerFailed) as report:
        ray_launcher._result_of(object(), 0, {}, [Here()], None)  # type: ignore[list-item]
    assert str(report.value) == "rollout actor on node n failed: KeyError: 'x' during rollout"
    assert "loops.py line 9" in report.value.traceback


def test_a_ray_rank_that_died_in_user_code_is_named_with_the_call(tmp_path, monkeypatch):
    """A tool's ``os._exit`` in a Ray rank: the actor's death is named with the phase and the
    user call its heartbeat last published."""
    import json
    import time

    import ray
    import ray.exceptions

    from megarl.distributed import ray_launcher
    from megarl.distributed.heartbeat import Beat, HeartbeatWatch, beat_path

    class Placement:
        pid = 4242

        def describe(self):
            return "actor+rollout rank 0 on node n (pid 4242)"

    beat = Beat(0, "n", 4242, 2, "rollout", time.time(), "tool crash: execute (sample 3)")
    beat_path(tmp_path, 0).write_text(json.dumps(beat.__dict__))

    def dead(ref, timeout=None):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(ray, "get", dead)
    watch = HeartbeatWatch(str(tmp_path), timeout_s=60)
    with pytest.raises(WorkerFailed) as report:
        ray_launcher._result_of(object(), 0, {}, [Placement()], watch)  # type: ignore[list-item]
    assert str(report.value).endswith(
        "the process died (killed, OOM or crashed: no Python error) during rollout of step 2, "
        "while running tool crash: execute (sample 3)"
    )

"""Training checkpoints: exact resume, resume at another TP layout, config checks, keep_last.

Tiny model on CPU in fp32. "Exact" means bitwise-equal parameters and identical per-step
metrics between a straight run and a run that stopped, was restarted and resumed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_llama_hf_config, value_model_folder
from helpers.runs import run_env, tiny_overrides

from megarl.checkpoint.convert import write_hf_folder
from megarl.checkpoint.layout import complete_checkpoints, optim_file, read_checkpoint
from megarl.models.hf_io import load_hf_state_dict
from megarl.train import StartupError, run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

# lr 1e-5: weights move ~1e-5 per step (checked), far above the 1e-6 tolerance of the TP-switch
# test, while TP=2 vs TP=1 float rounding, amplified by Adam in proportion to the lr, stays below
# it (at lr 1e-4 it reached 6e-6 after 3 steps at each layout).
COMMON = {"actor.lr": 1e-5}
ROUNDING = 1e-7
"""Plain vs distributed optimizer at one layout: the gradients' all-reduce and reduce-scatter
may round differently; a lost or misplaced Adam moment, or a reset step count, shows as ~lr."""
CURVE_KEYS = ("critic/rewards/mean", "actor/pg_loss")


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _curve(rows) -> list[tuple]:
    return [(r["step"], *(r[k] for k in CURVE_KEYS)) for r in rows]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 uninterrupted steps at TP=1: the reference for both resume tests."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    result = run(tiny_overrides(run_dir, 6, **COMMON), return_final_state=True)
    initial = load_hf_state_dict(run_dir / "init_model")
    assert _max_diff(result.final_state, initial) > 1e-5, "training barely moved the weights"
    return result.final_state, _metrics(run_dir)


def _stop_and_resume(tmp_path, first: dict, second: dict, steps=6, stop_at=3):
    run_dir = tmp_path / "resumed"
    stopped = run(
        tiny_overrides(run_dir, stop_at, **{**COMMON, "trainer.save_interval": stop_at, **first}),
        return_final_state=True,
    )
    assert [c.step for c in complete_checkpoints(run_dir)] == [stop_at]
    result = run(
        tiny_overrides(run_dir, steps, **{**COMMON, "trainer.save_interval": stop_at, **second}),
        return_final_state=True,
    )
    return stopped.final_state, result, _metrics(run_dir)


def test_resume_is_bitwise_exact(straight, tmp_path, capsys):
    straight_state, straight_rows = straight
    _, result, rows = _stop_and_resume(tmp_path, {}, {})
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _curve(rows) == _curve(straight_rows)
    assert [r["step"] for r in result.history] == [1, 2, 3, 4, 5, 6]
    assert any(r["actor/grad_norm"] > 0 for r in rows[3:]), "nothing trained after the resume"
    for name, tensor in straight_state.items():
        assert torch.equal(tensor, result.final_state[name]), name


def test_resume_at_another_layout(straight, tmp_path):
    """Saved at TP=2 x PP=2 (4 ranks), resumed at TP=1 x PP=1. The resharded load itself is
    bitwise (the saved shards reassemble to exactly the stopped run's weights); steps 4-6 then
    differ from the straight TP=1 run only by TP=2-vs-1 rounding of steps 1-3."""
    straight_state, straight_rows = straight
    tp2_pp2 = {"actor.tp": 2, "actor.pp": 2, "trainer.n_gpus_per_node": 4}
    stopped_state, result, rows = _stop_and_resume(tmp_path, tp2_pp2, {})
    saved = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_000003")
    assert (saved.tp, saved.pp) == (2, 2)
    write_hf_folder(saved, tmp_path, progress=False)
    resharded = load_hf_state_dict(tmp_path)
    assert all(torch.equal(stopped_state[k], resharded[k]) for k in stopped_state)
    assert [r["critic/rewards/mean"] for r in rows] == [
        r["critic/rewards/mean"] for r in straight_rows
    ]
    assert _max_diff(straight_state, result.final_state) <= 1e-6


def test_a_bf16_run_resumes_bitwise_from_its_fp32_main_copies(tmp_path):
    """``model.dtype=bfloat16`` on the CPU trains as CUDA does: bf16 weights, Megatron's fp32
    main copies in the optimizer. The checkpoint holds the main copies (``main_param``); the
    resumed run puts them back and refreshes the optimizer from them, so its steps equal the
    uninterrupted run's bit for bit (a main copy rebuilt from the bf16 weights would not)."""
    from safetensors.torch import load_file

    bf16 = {**COMMON, "model.dtype": "bfloat16", "trainer.save_interval": 2}
    straight = run(tiny_overrides(tmp_path / "straight", 4, **bf16), return_final_state=True)
    for name, tensor in straight.final_state.items():  # bf16 linear layers (the local
        if name.endswith("proj.weight"):  # spec's torch norms keep fp32), whatever the export
            assert torch.equal(tensor.to(torch.bfloat16).to(tensor.dtype), tensor), name
    run_dir = tmp_path / "resumed"
    run(tiny_overrides(run_dir, 2, **bf16))
    optim = load_file(run_dir / "checkpoints" / "step_000002" / optim_file(0, 0))
    mains = [key for key in optim if "main_param" in key]
    assert mains and all(optim[key].dtype == torch.float32 for key in mains), sorted(optim)[:5]
    resumed = run(tiny_overrides(run_dir, 4, **bf16), return_final_state=True)
    assert _curve(_metrics(run_dir)) == _curve(_metrics(tmp_path / "straight"))
    assert _max_diff(straight.final_state, resumed.final_state) == 0.0
    lp_diff = [r["rollout/logprob_abs_diff"] for r in resumed.history]
    assert all(d < 1e-2 for d in lp_diff), lp_diff  # the engine serves bf16 too


def test_the_distributed_optimizers_checkpoint_is_the_plain_ones(tmp_path):
    """Megatron's distributed optimizer (Adam state sliced over 2 data-parallel ranks) saves
    each parameter's whole state: the same weights and optimizer file as the plain optimizer's
    at the same layout, to the last bits the two reductions may round differently. Resumed at
    DP=1 and at TP=2, the two checkpoints then train the same next step."""
    from safetensors.torch import load_file

    dp2 = {**COMMON, "trainer.save_interval": 3, "trainer.n_gpus_per_node": 2}
    saved = {}
    for name, extra in {"plain": {}, "distributed": {"actor.optim.distributed": "true"}}.items():
        run_dir = tmp_path / name
        stopped = run(tiny_overrides(run_dir, 3, **dp2, **extra), return_final_state=True)
        optim = load_file(run_dir / "checkpoints" / "step_000003" / optim_file(0, 0))
        saved[name] = (run_dir, stopped.final_state, optim)
    (_, plain_weights, plain_optim), (_, dist_weights, dist_optim) = saved.values()
    assert sorted(plain_optim) == sorted(dist_optim)
    assert any("exp_avg_sq" in key for key in plain_optim), sorted(plain_optim)[:5]
    assert _max_diff(plain_weights, dist_weights) <= ROUNDING  # measured 5e-8
    assert _max_diff(plain_optim, dist_optim) <= ROUNDING  # measured 2e-9
    layouts = {"dp1": {}, "tp2": {"actor.tp": 2, "trainer.n_gpus_per_node": 2}}
    for layout, overrides in layouts.items():
        resumed = {}
        for name, (run_dir, _, _) in saved.items():
            copy = tmp_path / f"{name}-{layout}"
            shutil.copytree(run_dir, copy)
            args = tiny_overrides(copy, 4, **COMMON, **overrides)
            resumed[name] = run(args, return_final_state=True).final_state
        assert _max_diff(resumed["plain"], plain_weights) > 50 * ROUNDING, layout  # ~lr: 1e-5
        assert _max_diff(resumed["plain"], resumed["distributed"]) <= ROUNDING, layout  # 7e-8


def test_qwen3_saved_at_tp2_resumes_at_tp1(tmp_path):
    """Qwen3 (q/k norms) with the HF engine: a checkpoint written at TP=2 reassembles bitwise to
    the stopped run's weights, and a TP=1 run resumes from it and trains on."""
    run_dir = tmp_path / "qwen3"
    common = {**COMMON, "model": "tiny_qwen3", "trainer.save_interval": 2}
    stopped = run(
        tiny_overrides(run_dir, 2, **common, **{"actor.tp": 2, "trainer.n_gpus_per_node": 2}),
        return_final_state=True,
    )
    saved = read_checkpoint(run_dir / "checkpoints" / "step_000002")
    assert (saved.tp, saved.pp) == (2, 1)
    (tmp_path / "hf").mkdir()
    write_hf_folder(saved, tmp_path / "hf", progress=False)
    resharded = load_hf_state_dict(tmp_path / "hf")
    assert "model.layers.0.self_attn.q_norm.weight" in resharded
    assert sorted(resharded) == sorted(stopped.final_state)
    assert all(torch.equal(stopped.final_state[k], resharded[k]) for k in resharded)
    resumed = run(tiny_overrides(run_dir, 3, **common), return_final_state=True)
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    assert _max_diff(resharded, resumed.final_state) > 0, "the resumed step trained nothing"


def test_keep_last_and_mismatched_resume(tmp_path):
    """keep_last prunes older checkpoints; a resume that changes what matters is one line."""
    run_dir = tmp_path / "run"
    run(
        tiny_overrides(
            run_dir,
            4,
            **{
                "trainer.save_interval": 1,
                "trainer.keep_last": 2,
                "rollout.n": 2,
                "data.prompts_per_step": 1,
            },
        )
    )
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000004"]
    with pytest.raises(StartupError) as err:
        run(
            tiny_overrides(
                run_dir,
                6,
                **{
                    "trainer.save_interval": 1,
                    "trainer.seed": 7,
                    "model.hf_config.num_hidden_layers": 2,
                },
            )
        )
    message = str(err.value)
    assert "\n" not in message
    assert "trainer.seed: 1234 -> 7" in message
    assert "model num_layers: 4 -> 2" in message
    with pytest.raises(StartupError, match="no megarl_checkpoint.json"):
        run(tiny_overrides(run_dir, 6, **{"trainer.resume": str(tmp_path)}))
    assert len(_metrics(run_dir)) == 4, "a refused resume must not touch the run's metrics"


def _tmp_saves(run_dir) -> list:
    root = run_dir / "checkpoints"
    return [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.is_dir() else []


def _start_training(train_cli, run_dir, steps: int, log_path):
    """``megarl-train`` started in a process group of its own, its output into ``log_path``."""
    args = tiny_overrides(
        run_dir,
        steps,
        **{
            "trainer.save_interval": 1,
            "trainer.keep_last": 2,
            "rollout.n": 2,
            "data.prompts_per_step": 1,
        },
    )
    return train_cli.start(*args, cwd=REPO, env=run_env(), stdout=log_path, new_session=True)


def _kill_during_save(proc, run_dir, step: int, delay_s: float) -> bool:
    """SIGKILL the run ``delay_s`` after its save of ``step`` starts.

    Returns whether the kill landed inside that save, judged after the kill: a save publishes by
    renaming its ``.tmp-`` folder, and nothing removes a stale one until the next run saves, so
    the folder is still there exactly when the kill came first. A fast machine can finish a save
    inside ``delay_s`` (or between two polls); the caller accepts both outcomes.
    """
    root = run_dir / "checkpoints"
    wanted, published = root / f".tmp-step_{step:06d}", root / f"step_{step:06d}"
    deadline = time.monotonic() + 600
    while not (wanted.exists() or published.exists()):
        assert proc.poll() is None, "the run ended before the save to interrupt"
        assert time.monotonic() < deadline, "no save started"
        time.sleep(0.002)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout_s=60)
    return wanted.exists()


def test_sigkill_during_saves_resumes_from_last_complete_checkpoint(tmp_path, train_cli):
    """Each process resumes, saves one checkpoint, then is killed inside its next save (at 0 /
    50 / 150 ms); every time, the checkpoints left are complete and the next start resumes from
    the newest of them. Finally the run completes with one metrics line per step. (The processes
    are forked from a warm interpreter, see forked_cli.py: a SIGKILL ends them as it would a
    fresh ``megarl-train``.)"""
    run_dir, total = tmp_path / "run", 5
    log_path = tmp_path / "log.txt"
    newest, mid_save = 0, []
    for delay_s in (0.0, 0.05, 0.15):
        target = newest + 2  # this start saves newest + 1, then is killed saving newest + 2
        if target > total:
            break
        proc = _start_training(train_cli, run_dir, total, log_path)
        mid_save.append(_kill_during_save(proc, run_dir, target, delay_s))
        if newest:
            assert f"step_{newest:06d} (step {newest})" in log_path.read_text()
        steps = [c.step for c in complete_checkpoints(run_dir)]
        if mid_save[-1]:
            assert steps[-1] == target - 1, (delay_s, steps)
        else:  # the save finished before the kill: it is complete and counts
            assert steps[-1] >= target, (delay_s, steps)
        for child in (run_dir / "checkpoints").iterdir():
            if child.name.startswith("step_"):
                read_checkpoint(child)  # raises if incomplete
        newest = steps[-1]
    assert any(mid_save), "no kill landed inside a save"
    proc = _start_training(train_cli, run_dir, total, log_path)
    assert proc.wait(timeout_s=600) == 0, log_path.read_text()[-2000:]
    assert f"step_{newest:06d} (step {newest})" in log_path.read_text()
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, total + 1))
    assert [c.step for c in complete_checkpoints(run_dir)] == [total - 1, total]
    assert _tmp_saves(run_dir) == []


PPO = {
    "algo.adv_estimator": "gae",
    "algo.lam": 0.95,
    "critic.lr": 1e-4,
    "critic.value_head_init_std": 0.02,
}
PPO_CURVE_KEYS = ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var")


def test_ppo_resume_is_bitwise_exact(tmp_path, capsys):
    """With a critic: its trunk, value head and AdamW state come back from the checkpoint.

    The actor's weights after the resumed steps depend on the critic's values (through the
    advantages), so equal actor weights and equal ``critic/*`` metrics need an exact critic.
    A resume that forgot the critic (fresh head at 0.02 std) changes both, and so would one
    that started it from ``critic.model.path``, which the resumed half names (another value
    model with a scalar head)."""
    straight_dir = tmp_path / "straight"
    straight = run(tiny_overrides(straight_dir, 4, **COMMON, **PPO), return_final_state=True)
    other = value_model_folder(tmp_path / "value_model", tiny_llama_hf_config(), seed=7)
    assert other.score.weight.abs().max() > 0
    later = {**PPO, "critic.model.path": tmp_path / "value_model", "trainer.log_console": "true"}
    capsys.readouterr()
    _, resumed, rows = _stop_and_resume(tmp_path, PPO, later, steps=4, stop_at=2)
    assert "critic: restored from " in capsys.readouterr().out
    straight_rows = _metrics(straight_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _curve(rows) == _curve(straight_rows)
    ppo_curve = [[r[k] for k in PPO_CURVE_KEYS] for r in rows]
    assert ppo_curve == [[r[k] for k in PPO_CURVE_KEYS] for r in straight_rows]
    assert rows[2]["critic/values/mean"] != rows[0]["critic/values/mean"], "the critic never moved"
    for name, tensor in straight.final_state.items():
        assert torch.equal(tensor, resumed.final_state[name]), name


def test_ppo_resume_at_another_layout(tmp_path):
    """A PPO checkpoint saved at TP=2 resumes at TP=1: the critic's trunk is resharded like the
    actor's and its replicated head read back, so step 3's values (computed before any step-3
    update) match a straight TP=2 run up to TP rounding; a critic left at its initialisation
    would be off by the distance it moved in steps 1-2."""
    tp2 = {"actor.tp": 2, "trainer.n_gpus_per_node": 2}
    straight_dir = tmp_path / "straight"
    run(tiny_overrides(straight_dir, 3, **COMMON, **PPO, **tp2))
    straight_rows = _metrics(straight_dir)
    _, _, rows = _stop_and_resume(tmp_path, {**PPO, **tp2}, PPO, steps=3, stop_at=2)
    saved = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_000002")
    assert (saved.tp, saved.pp) == (2, 1)
    moved = abs(straight_rows[2]["critic/values/mean"] - straight_rows[0]["critic/values/mean"])
    diff = abs(rows[2]["critic/values/mean"] - straight_rows[2]["critic/values/mean"])
    print(
        f"critic values at step 3: resharded vs straight {diff:.1e}, moved by steps 1-2 {moved:.1e}"
    )
    assert diff <= 1e-5 < moved / 100, (diff, moved)
    assert rows[2]["critic/rewards/mean"] == straight_rows[2]["critic/rewards/mean"]

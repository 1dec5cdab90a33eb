"""Checkpoints of Megatron's optimizer on CUDA: its fp32 main copies and Adam moments, plain and
distributed, saved per parameter and restored exactly.

Skipped without CUDA. The distributed case runs on every visible GPU (data parallel over all of
them, so the optimizer's slices cut parameters); with one GPU it still takes the distributed
optimizer's code path with a single slice per parameter. The same module runs on CPU against
stand-ins of Megatron's optimizer in ``tests/unit/test_megatron_optim_state.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gpu_path import TINY, require_cuda

pytestmark = pytest.mark.gpu


def _actor(spec, state, distributed: bool):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed.execution import Environment, ExecutionRequest, decide_execution

    env = Environment(cuda_available=True, transformer_engine=False, device_name="cuda")
    plan = decide_execution(
        ExecutionRequest(device="cuda", model_dtype="bfloat16", distributed_optimizer=distributed),
        env,
    )
    cfg = ActorConfig(lr=1e-3)
    return MegatronActor(spec, cfg, "cuda", torch.bfloat16, state, pad_id=0, execution=plan)


def _step_with_seeded_grads(actor, seed: int) -> None:
    """One optimizer step on gradients drawn from ``seed`` (the same on every rank, so the
    distributed optimizer's slices need no reduction)."""
    g = torch.Generator().manual_seed(seed)
    actor.optimizer.zero_grad()
    for param in actor.model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=g).to(param.main_grad))
    actor.optimizer.step()


def _round_trip_worker(ctx, distributed: bool, folder: str):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megarl.checkpoint.shards import rank_optimizer_state, save_tensors
    from megarl.distributed import parallel
    from megarl.models.random_init import build_random_hf_model
    from megarl.models.spec import spec_from_hf_config

    parallel.init_process_group("cuda", ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    parallel.init_model_parallel(1, 1)
    spec = spec_from_hf_config(TINY)
    state = {k: v.clone() for k, v in build_random_hf_model(TINY, 3).state_dict().items()}
    trained = _actor(spec, state, distributed)
    for seed in (1, 2):
        _step_with_seeded_grads(trained, seed)
    states = trained.optimizer.param_states()  # collective
    path = Path(folder) / "optim.safetensors"
    if ctx.rank == 0:
        save_tensors(rank_optimizer_state(trained.local_params(), states), path)
        assert all(p in states for _, _, p in trained.local_params()), "a parameter lost its state"
    dist.barrier()

    saved = load_file(str(path))
    resumed = _actor(spec, state, distributed)  # the initial weights: a fresh start
    with torch.no_grad():
        for (_, _, src), (_, _, dst) in zip(
            trained.local_params(), resumed.local_params(), strict=True
        ):
            dst.copy_(src)  # the checkpoint's weights (bf16)
    resumed.optimizer.reload_model_params()
    for rule, layer, param in resumed.local_params():
        name = rule.mcore_name(layer)
        param_state = {k: saved[f"{k}/{name}"] for k in ("exp_avg", "exp_avg_sq", "main_param")}
        param_state["step"] = saved[f"step/{name}"].reshape(())
        resumed.optimizer.load_param_state(param, param_state)

    again = resumed.optimizer.param_states()
    out = {"mismatched_states": [], "mismatched_weights": []}
    if ctx.rank == 0:
        for rule, layer, param in resumed.local_params():
            name = rule.mcore_name(layer)
            for key, value in again[param].items():
                if not torch.equal(value.cpu().reshape(-1), saved[f"{key}/{name}"].reshape(-1)):
                    out["mismatched_states"].append(f"{key}/{name}")
    for model in (trained, resumed):
        _step_with_seeded_grads(model, 3)
    for (rule, layer, a), (_, _, b) in zip(
        trained.local_params(), resumed.local_params(), strict=True
    ):
        if not torch.equal(a, b):
            out["mismatched_weights"].append(rule.mcore_name(layer))
    out["params"] = len(list(trained.local_params()))
    parallel.destroy()
    return out


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_optimizer_state_round_trips_bitwise_and_the_next_step_matches(distributed, tmp_path):
    require_cuda()
    from megarl.distributed.launcher import launch

    world = torch.cuda.device_count() if distributed else 1
    results = launch(_round_trip_worker, world, args=(distributed, str(tmp_path)), timeout_s=600)
    for r in results:
        assert r["params"] > 0
        assert r["mismatched_states"] == [], r
        assert r["mismatched_weights"] == [], r


def test_grpo_run_on_gpu_saves_main_copies_and_resumes(tmp_path, capsys):
    """The trainer's own save and resume on CUDA with the distributed optimizer: the checkpoint
    holds every parameter's fp32 main copy and moments; the resumed run continues training."""
    require_cuda()
    from safetensors import safe_open

    from megarl.checkpoint.layout import complete_checkpoints
    from megarl.train import run

    common = [
        "trainer.device=cuda",
        f"trainer.run_dir={tmp_path}",
        "trainer.log_console=false",
        "trainer.tensorboard=false",
        "trainer.save_interval=2",
        "rollout.engine=hf",
        "rollout.n=4",
        "data.prompts_per_step=2",
        "rollout.max_new_tokens=16",
        "planner.prune_zero_adv=off",
        "actor.optim.distributed=true",
    ]
    run([*common, "trainer.total_steps=2"])
    [checkpoint] = complete_checkpoints(tmp_path)
    with safe_open(str(checkpoint.path / "optim_tp0_pp0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    names = {k.split("/", 1)[1] for k in keys if k.startswith("step/")}
    assert names, "no optimizer state saved"
    for name in names:
        assert {f"exp_avg/{name}", f"exp_avg_sq/{name}", f"main_param/{name}"} <= keys, name
    result = run([*common, "trainer.total_steps=3"])
    assert "resuming from" in capsys.readouterr().out
    assert [m["step"] for m in result.history][-1] == 3
    assert result.history[-1]["actor/grad_norm"] > 0

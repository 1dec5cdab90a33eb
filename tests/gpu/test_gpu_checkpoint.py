"""Checkpoints of Megatron's optimizer in bf16: its fp32 main copies and Adam moments, plain and
distributed, saved per parameter and restored exactly.

The round trip runs on the CPU (gloo, the CPU shims: the same Megatron optimizer, two
data-parallel ranks when distributed, so the optimizer's slices cut parameters) and, where CUDA
is, on every visible GPU (with one GPU the distributed case still takes the distributed
optimizer's code path, a single slice per parameter). The trainer's own save and resume on
CUDA is skipped without it (its CPU twin: ``tests/integration/test_checkpoint_resume.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.ranks import start_rank
from test_gpu_path import TINY, require_cuda

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _actor(spec, state, distributed: bool, device: str):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed.execution import Environment, ExecutionRequest, decide_execution

    env = Environment(cuda_available=device == "cuda", transformer_engine=False)
    request = ExecutionRequest(
        device=device, model_dtype="bfloat16", distributed_optimizer=distributed
    )
    plan = decide_execution(request, env)
    assert plan.optimizer == "megatron" and plan.params_dtype == "bfloat16", plan
    cfg = ActorConfig(lr=1e-3)
    return MegatronActor(spec, cfg, device, torch.bfloat16, state, pad_id=0, execution=plan)


def _step_with_seeded_grads(actor, seed: int) -> None:
    """One optimizer step on gradients drawn from ``seed`` (the same on every rank, so the
    distributed optimizer's slices need no reduction)."""
    g = torch.Generator().manual_seed(seed)
    actor.optimizer.zero_grad()
    for param in actor.model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=g).to(param.main_grad))
    actor.optimizer.step()


def _round_trip_worker(ctx, device: str, distributed: bool, folder: str):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megarl.checkpoint.shards import rank_optimizer_state, save_tensors
    from megarl.distributed import parallel
    from megarl.models.random_init import build_random_hf_model
    from megarl.models.spec import spec_from_hf_config

    start_rank(ctx, device)
    spec = spec_from_hf_config(TINY)
    state = {k: v.clone() for k, v in build_random_hf_model(TINY, 3).state_dict().items()}
    trained = _actor(spec, state, distributed, device)
    for seed in (1, 2):
        _step_with_seeded_grads(trained, seed)
    states = trained.optimizer.param_states()  # collective
    path = Path(folder) / "optim.safetensors"
    if ctx.rank == 0:
        save_tensors(rank_optimizer_state(trained.local_params(), states), path)
        assert all(p in states for _, _, p in trained.local_params()), "a parameter lost its state"
    dist.barrier()

    saved = load_file(str(path))
    resumed = _actor(spec, state, distributed, device)  # the initial weights: a fresh start
    with torch.no_grad():
        for (_, _, src), (_, _, dst) in zip(
            trained.local_params(), resumed.local_params(), strict=True
        ):
            dst.copy_(src)  # the checkpoint's weights (bf16)
    resumed.optimizer.reload_model_params()
    for rule, layer, param in resumed.local_params():
        name = rule.mcore_name(layer)
        # a bf16 weight's fp32 main copy; an fp32 one (the local spec's torch norms) has none
        keys = [k for k in ("exp_avg", "exp_avg_sq", "main_param") if f"{k}/{name}" in saved]
        param_state = {k: saved[f"{k}/{name}"] for k in keys}
        param_state["step"] = saved[f"step/{name}"].reshape(())
        resumed.optimizer.load_param_state(param, param_state)

    again = resumed.optimizer.param_states()
    out = {"mismatched_states": [], "mismatched_weights": []}
    out["main_copies"] = sum(key.startswith("main_param/") for key in saved)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_optimizer_state_round_trips_bitwise_and_the_next_step_matches(
    device, distributed, tmp_path
):
    from megarl.distributed.launcher import launch

    if device == "cuda":
        require_cuda()
        world = torch.cuda.device_count() if distributed else 1
    else:
        world = 2 if distributed else 1
    args = (device, distributed, str(tmp_path))
    results = launch(_round_trip_worker, world, args=args, timeout_s=600)
    for r in results:
        assert r["params"] > 0 and r["main_copies"] > 0
        assert r["mismatched_states"] == [], r
        assert r["mismatched_weights"] == [], r


@pytest.mark.gpu
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
        "data.reward=integration.synthetic_rewards:char_parity",  # mixed rewards: a gradient
        "actor.optim.distributed=true",
    ]
    run([*common, "trainer.total_steps=2"])
    [checkpoint] = complete_checkpoints(tmp_path)
    with safe_open(str(checkpoint.path / "optim_tp0_pp0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    names = {k.split("/", 1)[1] for k in keys if k.startswith("step/")}
    assert names, "no optimizer state saved"
    for name in names:  # main copies of the bf16 weights (the local spec keeps norms in fp32)
        assert {f"exp_avg/{name}", f"exp_avg_sq/{name}"} <= keys, name
        if name.endswith("linear_proj.weight"):
            assert f"main_param/{name}" in keys, name
    result = run([*common, "trainer.total_steps=3"])
    assert "resuming from" in capsys.readouterr().out
    assert [m["step"] for m in result.history][-1] == 3
    assert result.history[-1]["actor/grad_norm"] > 0

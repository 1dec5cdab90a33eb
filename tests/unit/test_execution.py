"""The execution plan: device + installed packages + config -> decisions, with reasons."""

from __future__ import annotations

import pytest

from megarl.distributed.execution import (
    Environment,
    ExecutionError,
    ExecutionRequest,
    decide_execution,
    execution_plan_for,
    resolve_device,
)

CPU = Environment(cuda_available=False, transformer_engine=False)
H100_TE = Environment(cuda_available=True, transformer_engine=True, device_name="NVIDIA H100")
H100_NO_TE = Environment(cuda_available=True, transformer_engine=False, device_name="NVIDIA H100")


def test_auto_picks_cuda_when_present():
    assert resolve_device("auto", H100_TE) == "cuda"
    assert resolve_device("auto", CPU) == "cpu"
    assert resolve_device("cpu", H100_TE) == "cpu"
    with pytest.raises(ExecutionError, match="trainer.device=cuda"):
        resolve_device("cuda", CPU)


def test_cpu_plan_enters_shims_and_ignores_cuda_only_features_with_a_reason():
    plan = decide_execution(
        ExecutionRequest(distributed_optimizer=True, overlap_grad_reduce=True, recompute="full"),
        CPU,
    )
    assert (plan.device, plan.backend, plan.cpu_shims, plan.params_dtype) == (
        "cpu",
        "gloo",
        True,
        "float32",
    )
    assert plan.optimizer == "megatron" and plan.distributed_optimizer  # runs on CPU too
    assert plan.recompute is None and not plan.overlap_grad_reduce
    assert plan.layer_spec == "local" and plan.attention_core == "sdpa"
    assert plan.packed_attention == "sdpa_blocks"
    assert any("overlap_grad_reduce" in r and "actor.recompute" in r for r in plan.reasons)
    assert not any("actor.optim.distributed" in r for r in plan.reasons)


@pytest.mark.parametrize("env", [CPU, H100_TE], ids=["cpu", "cuda"])
def test_the_optimizer_is_megatrons_unless_torch_is_asked_for(env):
    auto = decide_execution(ExecutionRequest(), env)
    assert (auto.optimizer, auto.distributed_optimizer) == ("megatron", False)
    assert any("optimizer: Megatron's, plain (impl=auto)" in r for r in auto.reasons)
    torch_plan = decide_execution(ExecutionRequest(optimizer_impl="torch"), env)
    assert torch_plan.optimizer == "torch_adamw"
    assert any("torch AdamW" in r for r in torch_plan.reasons)


def test_cuda_plan_with_transformer_engine():
    request = ExecutionRequest(
        distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        recompute="selective",
    )
    plan = decide_execution(request, H100_TE)
    assert (plan.device, plan.backend, plan.cpu_shims) == ("cuda", "nccl", False)
    assert plan.params_dtype == "bfloat16" and plan.grad_reduce_in_fp32
    assert plan.optimizer == "megatron" and plan.distributed_optimizer
    assert plan.overlap_grad_reduce and plan.overlap_param_gather
    assert plan.recompute == "selective"
    assert plan.use_transformer_engine and plan.attention_core == "te"
    assert plan.packed_attention == "te_thd"
    assert "H100" in plan.reasons[0]


def test_cuda_without_transformer_engine_uses_local_spec_with_sdpa():
    plan = decide_execution(ExecutionRequest(), H100_NO_TE)
    assert plan.layer_spec == "local" and plan.attention_core == "sdpa"
    assert plan.packed_attention == "sdpa_blocks"
    assert any("not installed" in r for r in plan.reasons)


def test_packing_off_and_explicit_dtype():
    plan = decide_execution(ExecutionRequest(pack_sequences=False, model_dtype="float32"), H100_TE)
    assert plan.packed_attention == "none" and not plan.pack_sequences
    assert plan.params_dtype == "float32"


def test_overlap_param_gather_needs_distributed_optimizer():
    with pytest.raises(ExecutionError, match="overlap_param_gather"):
        decide_execution(ExecutionRequest(overlap_param_gather=True), H100_TE)


def test_request_from_run_config():
    from megarl.config.schema import build_run_config

    cfg = build_run_config(
        {
            "trainer": {"device": "cpu"},
            "actor": {"recompute": "full", "pack_sequences": False, "optim": {"distributed": True}},
        }
    )
    request = ExecutionRequest.from_config(cfg)
    assert request == ExecutionRequest(
        device="cpu", pack_sequences=False, distributed_optimizer=True, recompute="full"
    )


@pytest.mark.parametrize("section", ["actor", "critic"])
def test_an_optimizer_that_cannot_be_is_refused_by_name(section):
    from megarl.config.schema import ConfigError, build_run_config

    with pytest.raises(ConfigError, match=rf"{section}\.optim\.impl='adafactor'"):
        build_run_config({section: {"optim": {"impl": "adafactor"}}})
    with pytest.raises(ConfigError, match=rf"{section}\.optim\.distributed=true needs Megatron"):
        build_run_config({section: {"optim": {"impl": "torch", "distributed": True}}})


def test_the_critic_trains_with_its_own_optimizer_settings():
    from megarl.config.schema import build_run_config

    cfg = build_run_config({"critic": {"optim": {"impl": "torch"}}})
    assert execution_plan_for(cfg, "cpu").optimizer == "megatron"
    assert execution_plan_for(cfg, "cpu", optim=cfg.critic.optim).optimizer == "torch_adamw"


def test_detect_environment_reads_torch(monkeypatch):
    import torch

    from megarl.distributed import execution

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(execution.importlib.util, "find_spec", lambda name: None)
    env = execution.detect_environment()
    assert env == Environment(
        cuda_available=True, transformer_engine=False, device_name="NVIDIA H200"
    )


def test_te_param_names_map_to_local_spec_names():
    from megarl.models.megatron_gpt import canonical_param_name

    assert (
        canonical_param_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
        == "decoder.layers.3.input_layernorm.weight"
    )
    assert (
        canonical_param_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
        == "decoder.layers.0.pre_mlp_layernorm.weight"
    )
    assert (
        canonical_param_name("decoder.layers.0.mlp.linear_fc1.weight")
        == "decoder.layers.0.mlp.linear_fc1.weight"
    )


def test_cli_reports_execution_errors_as_startup_errors(monkeypatch):
    import torch

    from megarl.config.schema import build_run_config
    from megarl.train import StartupError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(StartupError, match="no CUDA device"):
        resolve_device("cuda")
    bad = build_run_config({"actor": {"optim": {"overlap_param_gather": True}}})
    with pytest.raises(StartupError, match="actor.optim.distributed=true"):
        resolve_device("auto", bad)


@pytest.mark.parametrize(
    ("recompute", "fields"),
    [
        (None, (None, None, None)),
        ("selective", ("selective", None, None)),
        ("full", ("full", "uniform", 1)),
    ],
)
def test_plan_recompute_reaches_transformer_config(recompute, fields):
    """actor.recompute -> the plan -> Megatron TransformerConfig's recompute fields."""
    import torch
    from helpers.models import TINY_HF_CONFIG

    from megarl.models.megatron_gpt import transformer_config
    from megarl.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(dict(TINY_HF_CONFIG, num_hidden_layers=2))
    plan = decide_execution(ExecutionRequest(recompute=recompute or "none"), H100_TE)
    config = transformer_config(
        spec, 1, 1, torch.bfloat16, use_cpu_initialization=True, recompute=plan.recompute
    )
    assert (
        config.recompute_granularity,
        config.recompute_method,
        config.recompute_num_layers,
    ) == fields
    assert config.bf16 and config.params_dtype == torch.bfloat16


def test_split_placement_on_cpu_gives_the_rollout_cores_of_its_own():
    from megarl.distributed.execution import split_cpu_cores

    split = split_cpu_cores([3, 0, 1, 2], rollout_devices=1)
    assert split is not None and (split.rollout, split.ranks) == ((3,), (0, 1, 2))
    assert split.describe() == "CPU cores: rollout actor [3], ranks [0, 1, 2]"
    assert split_cpu_cores([0, 1, 2, 3], 2) == split_cpu_cores([2, 3, 1, 0], 2)
    assert split_cpu_cores([0, 1], 2) is None  # the ranks need a core: share instead
    assert split_cpu_cores([0], 1) is None


def test_pinning_binds_every_thread_of_the_process():
    import os
    import threading

    from megarl.distributed.execution import pin_to_cores

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    core = min(before)
    ready, done = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def worker():
        ready.set()
        done.wait(10)
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait(10)
    try:
        pin_to_cores([core])  # the worker already runs: it is bound too
        done.set()
        thread.join(10)
        assert seen == [{core}] and os.sched_getaffinity(0) == {core}
    finally:
        pin_to_cores(sorted(before))

"""What a rank worker of the integration tests does first, the actor it builds and the loss it
trains with."""

from __future__ import annotations

from typing import Any


def start_cpu_rank(ctx, tp: int, pp: int = 1, vpp: int | None = None, ep: int = 1) -> None:
    """:func:`start_rank` on the CPU."""
    start_rank(ctx, "cpu", tp, pp, vpp, ep)


def start_rank(
    ctx, device: str, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1
) -> None:
    """Join the launcher's process group as ``ctx.rank`` (gloo with the CPU shims on ``cpu``,
    NCCL on ``cuda``) and build Megatron's TP/PP(/VPP)/EP groups."""
    from megarl.distributed import parallel

    if device == "cpu":
        from megarl.distributed.platform import enter_cpu_shims

        enter_cpu_shims()
    parallel.join_launched_group(ctx, device)
    parallel.init_model_parallel(tp, pp, vpp, ep=ep)


def cpu_actor(hf_config: dict, cfg: Any, state: Any, trainable: bool, **options: Any):
    """The fp32 Megatron actor of ``hf_config`` under ``cfg`` (an ``ActorConfig``) on this CPU
    rank, loaded from the HF tensors ``state`` (pad id 0); ``options`` go to ``MegatronActor``."""
    import torch

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(hf_config)
    return MegatronActor(
        spec, cfg, "cpu", torch.float32, state, pad_id=0, trainable=trainable, **options
    )


def loss_settings(**changes: Any):
    """PPO-clip at 0.2, token-mean, no KL, no entropy bonus, temperature 1; ``changes`` over it."""
    from megarl.actor.training_loss import LossSettings

    values: dict[str, Any] = {
        "temperature": 1.0,
        "clip_low": 0.2,
        "clip_high": 0.2,
        "agg": "token-mean",
        "kl_coef": 0.0,
        "kl_estimator": "low_var_kl",
        "entropy_coef": 0.0,
        **changes,
    }
    return LossSettings(**values)

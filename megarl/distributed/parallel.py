"""Process-group set-up for Megatron ranks, on CPU (gloo) and GPU (NCCL).

Every collective gets a timeout (``trainer.collective_timeout_s``, default 600 s, passed in by the
rank loop on every rank under either launcher): a dead or stuck peer turns into an error instead
of a silent hang, and the launcher names the rank that stopped (see :mod:`megarl.distributed.heartbeat`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the TP x PP x DP grid (Megatron's rank order: TP fastest)."""

    world_size: int
    rank: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def init_process_group(
    device: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store_hosted: bool = False,
) -> None:
    """Join the global group: gloo on CPU, NCCL on CUDA (with a gloo-free default); every
    collective of the group fails after ``timeout_s`` instead of waiting forever.

    The rendezvous store is on ``master_addr:master_port``: rank 0 opens it there, or with
    ``store_hosted`` the launcher already holds it and every rank connects (the local launcher
    does, so no port is picked free and bound later: another process can take it in between).
    A world of one keeps its rendezvous in memory, for the same reason."""
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None  # rank 0 opens it at init_method
    if world_size == 1:
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]  (public, untyped)
    elif store_hosted:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  (public, untyped)
            master_addr, master_port, world_size, False, timeout=timeout
        )
    dist.init_process_group(
        backend=backend,
        init_method=None if store is not None else f"tcp://{master_addr}:{master_port}",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def join_launched_group(ctx: Any, device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """:func:`init_process_group` in a worker a launcher started
    (:class:`megarl.distributed.launcher.WorkerContext`: its rank, the world and the
    rendezvous, which the launcher may already hold)."""
    init_process_group(
        device,
        ctx.rank,
        ctx.world_size,
        ctx.master_addr,
        ctx.master_port,
        timeout_s,
        store_hosted=ctx.store_hosted,
    )


def init_model_parallel(
    tp: int,
    pp: int,
    vpp: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ep: int = 1,
    seed: int = 1234,
) -> ParallelLayout:
    """Create Megatron's TP/PP/DP (and expert-parallel) groups on top of the global group, with
    the same timeout. Experts are split over ``ep`` ranks of the data-parallel dimension, each
    expert's weights over TP as the dense layers' are."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        # annotated int, but only ever given to timedelta(minutes=...), which takes a float
        distributed_timeout_minutes=timeout_s / 60,  # pyright: ignore[reportArgumentType]
    )
    if torch.cuda.is_available():
        # the model-parallel RNG states sequence-parallel layers and expert inits fork from
        # (on CPU the fork is a no-op: megarl.distributed.platform)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(world_size=dist.get_world_size(), rank=dist.get_rank(), tp=tp, pp=pp)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

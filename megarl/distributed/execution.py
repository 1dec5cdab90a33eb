"""How this run executes on this machine: one pure decision, made once, with reasons.

The device decides a handful of things and nothing else (``shared/GUIDE.md`` section 5): the
process-group backend, whether the CPU shims for Megatron are entered, the parameter dtype, the
optimizer, the layer spec and attention core, how packed micro-batches attend, and which
CUDA-only features (distributed optimizer, overlapped communication, activation recomputation)
are on. :func:`decide_execution` maps *(requested device, what is installed, the config)* to a
frozen :class:`ExecutionPlan`; workers only read it. It is pure (no torch import), so every
branch is unit-tested on a CPU machine by passing a fake :class:`Environment`;
:func:`detect_environment` is the only place that looks at the real machine.

Decisions, and why:

- The optimizer (``actor.optim.impl``): Megatron's own wherever it runs (``auto``), on CUDA and,
  through the CPU shims, on the CPU, plain or distributed (state sharded over DP) -- the code
  every GPU user runs is the code the CPU suite tests. ``torch``: ``torch.optim.AdamW`` over
  Megatron's main grads (:class:`megarl.actor.optim.CpuAdamW`), megarl's own.
- CPU: gloo, fp32 (``model.dtype=auto``; bf16 on request), shims on, local spec with SDPA core
  attention; packed micro-batches attend block by block (a block-diagonal causal mask evaluated
  per sequence). Overlapped
  communication and recomputation are CUDA-only (Megatron's recompute saves CUDA RNG state) and
  are ignored with a reason, so one config runs on both devices.
- CUDA: NCCL, bf16 parameters (``model.dtype=auto``) with fp32 main grads and fp32 gradient
  reduction, Megatron's optimizer (distributed when ``actor.optim.distributed``), overlap flags as
  configured, recomputation as configured. transformer-engine's layer spec when it imports (its
  fused attention runs packed THD batches natively); otherwise the local spec with SDPA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class ExecutionError(ValueError):
    """The requested execution cannot run here (e.g. cuda requested, none present)."""


OPTIMIZER_IMPLS: tuple[str, ...] = ("auto", "megatron", "torch")
"""``actor.optim.impl``: ``auto`` (Megatron's optimizer: it runs on every device), ``megatron``,
``torch`` (``torch.optim.AdamW`` over Megatron's main grads; no distributed form)."""


@dataclass(frozen=True)
class Environment:
    """What the machine offers (detected once; faked in tests)."""

    cuda_available: bool
    transformer_engine: bool
    device_name: str | None = None
    """``torch.cuda.get_device_name()`` when CUDA is present (selects the MFU peak)."""


@dataclass(frozen=True)
class ExecutionRequest:
    """The config keys that the decision reads (plain values, so tests need no RunConfig)."""

    device: str = "auto"
    """trainer.device: auto | cpu | cuda."""
    model_dtype: str = "auto"
    """model.dtype: auto | float32 | bfloat16."""
    pack_sequences: bool = True
    optimizer_impl: str = "auto"
    """actor.optim.impl: auto | megatron | torch."""
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute: str = "none"

    @classmethod
    def from_config(cls, cfg, optim=None) -> ExecutionRequest:
        """From a :class:`megarl.config.schema.RunConfig`; ``optim``: another model's optimizer
        settings (``critic.optim``) in place of ``actor.optim``."""
        return cls.for_actor(cfg.actor, cfg.trainer.device, cfg.model.dtype, optim)

    @classmethod
    def for_actor(
        cls, actor, device: str, model_dtype: str = "auto", optim=None
    ) -> ExecutionRequest:
        """From an :class:`megarl.config.actor.ActorConfig` alone (a model built outside a run:
        tests, benchmarks, tools); the one mapping of its keys to the request's."""
        optim = optim or actor.optim
        return cls(
            device=device,
            model_dtype=model_dtype,
            pack_sequences=actor.pack_sequences,
            optimizer_impl=optim.impl,
            distributed_optimizer=optim.distributed,
            overlap_grad_reduce=optim.overlap_grad_reduce,
            overlap_param_gather=optim.overlap_param_gather,
            recompute=actor.recompute,
        )


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything device-dependent about one run; read by workers, decided nowhere else."""

    device: str
    """cpu | cuda."""
    backend: str
    """gloo | nccl."""
    cpu_shims: bool
    params_dtype: str
    """float32 | bfloat16 (torch attribute names)."""
    grad_reduce_in_fp32: bool
    optimizer: str
    """torch_adamw | megatron."""
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    recompute: str | None
    """Megatron ``recompute_granularity``: None | selective | full."""
    layer_spec: str
    """transformer_engine | local."""
    attention_core: str
    """te (TEDotProductAttention) | sdpa (:class:`megarl.distributed.platform.SDPACoreAttention`)."""
    packed_attention: str
    """How a packed micro-batch attends: te_thd | sdpa_blocks | none (padded micro-batches)."""
    reasons: tuple[str, ...] = ()

    @property
    def pack_sequences(self) -> bool:
        return self.packed_attention != "none"

    @property
    def use_transformer_engine(self) -> bool:
        return self.layer_spec == "transformer_engine"

    def summary(self) -> str:
        """One line for the start-up log."""
        return (
            f"{self.device}/{self.backend} {self.params_dtype} | optim {self.optimizer}"
            f"{' (distributed)' if self.distributed_optimizer else ''} | spec {self.layer_spec}"
            f" + {self.attention_core} | packing {self.packed_attention} | recompute "
            f"{self.recompute or 'none'}"
        )


def detect_environment() -> Environment:
    """Look at the real machine: CUDA, its name, and whether transformer-engine is installed."""
    import torch

    cuda = torch.cuda.is_available()
    return Environment(
        cuda_available=cuda,
        transformer_engine=cuda and importlib.util.find_spec("transformer_engine") is not None,
        device_name=torch.cuda.get_device_name() if cuda else None,
    )


def resolve_device(requested: str, env: Environment) -> str:
    """auto -> cuda when present; an explicit cuda without CUDA is an error."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ExecutionError(f"trainer.device={requested!r}: must be auto, cpu or cuda")
    if requested == "auto":
        return "cuda" if env.cuda_available else "cpu"
    if requested == "cuda" and not env.cuda_available:
        raise ExecutionError("trainer.device=cuda but no CUDA device is available")
    return requested


def decide_execution(request: ExecutionRequest, env: Environment) -> ExecutionPlan:
    """The execution plan for ``request`` on a machine like ``env`` (pure).

    Both devices share one rule for every field; what differs is said by ``cuda`` (the
    backend, the shims, the default dtype, whether the CUDA-only features run) and by whether
    transformer-engine's spec is used (the layer spec, the attention core, how packed
    micro-batches attend). The reasons are each device's own.
    """
    if request.overlap_param_gather and not request.distributed_optimizer:
        raise ExecutionError(
            "actor.optim.overlap_param_gather=true needs "
            "actor.optim.distributed=true (params are gathered from DP shards)"
        )
    device = resolve_device(request.device, env)
    cuda = device == "cuda"
    te = cuda and env.transformer_engine
    dtype = request.model_dtype
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    optimizer, why = _optimizer(request)
    reasons = _cuda_reasons(request, env, dtype, why) if cuda else _cpu_reasons(request, dtype, why)
    return ExecutionPlan(
        device=device,
        backend="nccl" if cuda else "gloo",
        cpu_shims=not cuda,
        params_dtype=dtype,
        grad_reduce_in_fp32=True,
        optimizer=optimizer,
        distributed_optimizer=request.distributed_optimizer,
        overlap_grad_reduce=cuda and request.overlap_grad_reduce,
        overlap_param_gather=cuda and request.overlap_param_gather,
        recompute=request.recompute if cuda and request.recompute != "none" else None,
        layer_spec="transformer_engine" if te else "local",
        attention_core="te" if te else "sdpa",
        packed_attention=("te_thd" if te else "sdpa_blocks") if request.pack_sequences else "none",
        reasons=reasons,
    )


def _optimizer(request: ExecutionRequest) -> tuple[str, str]:
    """The optimizer's name in the plan and the reason for it."""
    if request.optimizer_impl == "torch":
        return "torch_adamw", "optimizer: torch AdamW over Megatron's main grads (impl=torch)"
    form = "distributed (state sharded over DP)" if request.distributed_optimizer else "plain"
    return "megatron", f"optimizer: Megatron's, {form} (impl={request.optimizer_impl})"


def execution_plan_for(cfg, device: str, optim=None) -> ExecutionPlan:
    """The run's plan on the device the launcher resolved (``cfg``: a ``RunConfig``); what every
    rank executes and what the rollout host sizes its engine from. ``optim``: another model's
    optimizer settings (``critic.optim``) in place of ``actor.optim``."""
    import dataclasses

    request = dataclasses.replace(ExecutionRequest.from_config(cfg, optim), device=device)
    return decide_execution(request, detect_environment())


def _cpu_reasons(request: ExecutionRequest, dtype: str, optimizer_why: str) -> tuple[str, ...]:
    """The CPU plan's reasons, the CUDA-only features it ignores named."""
    reasons = [f"cpu: gloo, {dtype} parameters, Megatron CPU shims", optimizer_why]
    ignored = [
        name
        for name, on in (
            ("actor.optim.overlap_grad_reduce", request.overlap_grad_reduce),
            ("actor.optim.overlap_param_gather", request.overlap_param_gather),
            ("actor.recompute", request.recompute != "none"),
        )
        if on
    ]
    if ignored:
        reasons.append(f"ignored on cpu (CUDA-only): {', '.join(ignored)}")
    reasons.append(
        "packing: "
        + (
            "one row per micro-batch, SDPA per sequence block"
            if request.pack_sequences
            else "off (right-padded rows)"
        )
    )
    return tuple(reasons)


def _cuda_reasons(
    request: ExecutionRequest, env: Environment, dtype: str, optimizer_why: str
) -> tuple[str, ...]:
    """The CUDA plan's reasons: the GPU, the precision, and which layer spec imports."""
    if env.transformer_engine:
        spec = "transformer-engine installed: TE layer spec, fused attention (THD packing)"
    else:
        spec = "transformer-engine not installed: local spec with SDPA core attention" + (
            " (packed batches attend per sequence block)" if request.pack_sequences else ""
        )
    return (
        f"cuda ({env.device_name or 'unknown GPU'}): nccl",
        optimizer_why,
        f"params {dtype}, fp32 main grads and fp32 gradient reduction",
        spec,
    )


# --- split placement on one CPU machine ----------------------------------------------------


@dataclass(frozen=True)
class CoreSplit:
    """Split placement on one CPU machine: the cores of the rollout actor and of the ranks."""

    rollout: tuple[int, ...]
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"CPU cores: rollout actor {list(self.rollout)}, ranks {list(self.ranks)}"


def split_cpu_cores(available: Sequence[int], rollout_devices: int) -> CoreSplit | None:
    """The CPU analogue of separate device pools (``rollout.n_gpus=N`` on CPU): the rollout
    actor gets ``N`` cores of its own (the highest numbered), the ranks share the rest, so
    generation and training do not take each other's cores, as they would not take each
    other's GPUs. None when there are too few cores to leave the ranks one."""
    cores = sorted(available)
    if rollout_devices < 1 or len(cores) <= rollout_devices:
        return None
    return CoreSplit(rollout=tuple(cores[-rollout_devices:]), ranks=tuple(cores[:-rollout_devices]))


def pin_to_cores(cores: Sequence[int]) -> None:
    """Bind every thread of this process (and the threads it starts later, which inherit it)
    to ``cores``; Linux only (elsewhere a no-op)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, set(cores))

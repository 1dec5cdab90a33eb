"""Optimizers for the Megatron actor and critic: one interface, chosen by ``actor.optim.impl``.

:class:`MegatronOptimizer` is Megatron-Core's own (fp32 main copies of bf16 weights, the
distributed form sharding its state over DP), on CUDA and, through the CPU shims
(:mod:`megarl.distributed.platform`), on the CPU: what a GPU run trains with is what the CPU
suite tests. :class:`CpuAdamW` (``impl=torch``) is ``torch.optim.AdamW`` over the DDP-wrapped
parameters, whose gradients Megatron keeps in ``param.main_grad``; its grad-norm clipping is
done over the whole model-parallel group, counting each parameter once (TP duplicates such as
norms and the tied output-layer copy are skipped), so the norm equals the unsharded model's.

Both return the gradient norm of every step, clipping or not, and apply nothing when it is not
finite (the same on every rank): what to do then is :mod:`megarl.algo.divergence`'s decision.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import torch
import torch.distributed as dist

from megarl.config.actor import ActorConfig


class ActorOptimizer(abc.ABC):
    """The interface both optimizers give the actor, the critic and checkpoints: a step that
    returns the gradient norm, and the state of the wrapped torch or Megatron optimizer
    (``inner``), whole or per parameter."""

    inner: Any

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def step(self) -> float:
        """Apply one update unless the gradient norm is not finite; return that norm."""

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    @abc.abstractmethod
    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Each trained parameter's optimizer state, keyed by parameter (for resharding)."""

    @abc.abstractmethod
    def reload_model_params(self) -> None:
        """Make the optimizer follow weights a checkpoint load just wrote into the model."""

    @abc.abstractmethod
    def load_param_state(self, param, state: dict[str, torch.Tensor]) -> None:
        """Restore one parameter's saved state (as :meth:`param_states` gave it)."""


class CpuAdamW(ActorOptimizer):
    """AdamW over ``main_grad`` with model-parallel-aware global-norm clipping."""

    def __init__(self, chunks: list, cfg: ActorConfig):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.cfg = cfg
        self.inner = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=(cfg.optim.betas[0], cfg.optim.betas[1]),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> float:
        """Apply one update (also for a ghost step with all-zero gradients); returns the grad
        norm. A non-finite norm (the same on every rank) applies nothing: the caller decides
        (:mod:`megarl.algo.divergence`)."""
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        norm = global_grad_norm(self.params)
        if not math.isfinite(norm):
            return norm
        clip = self.cfg.optim.grad_clip
        if clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)
            for p in self.params:
                p.grad.mul_(scale)
        self.inner.step()
        return norm

    # --- per-parameter state for checkpoints (megarl.checkpoint) -----------------------------

    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """AdamW's state of every parameter that has one (``exp_avg``, ``exp_avg_sq``,
        ``step``; none before the first step). Keyed by parameter so a checkpoint can reshard
        it like the weights. Called on every rank (Megatron's optimizer needs a collective)."""
        return {p: dict(self.inner.state[p]) for p in self.params if p in self.inner.state}

    def reload_model_params(self) -> None:
        """Nothing to refresh: AdamW updates the model's own parameters."""

    @torch.no_grad()
    def load_param_state(self, param, state: dict[str, torch.Tensor]) -> None:
        """One parameter's saved state; a ``main_param`` (the fp32 master copy a GPU run saves
        next to its bf16 weights) is the parameter's exact value and replaces it."""
        state = dict(state)
        main = state.pop("main_param", None)
        if main is not None:
            param.copy_(main.to(param.dtype))
        self.inner.state[param] = {
            key: value.to(param.device).clone() for key, value in state.items()
        }


def _counts_for_norm(param) -> bool:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if getattr(param, "shared_embedding", False) and not ps.is_pipeline_first_stage(
        ignore_virtual=True
    ):
        return False  # the tied output layer on the last stage copies the first stage's embedding
    return param_is_not_tensor_parallel_duplicate(param)


def global_grad_norm(params) -> float:
    """L2 norm of all gradients across TP and PP ranks (DP replicas hold equal grads).

    A mixture-of-experts model's expert parameters (Megatron marks them ``allreduce=False``)
    differ across expert-parallel ranks, so their squares are summed over the expert groups
    (EP x expert-TP x PP) instead.
    """
    from megatron.core import parallel_state as ps

    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None and _counts_for_norm(p):
            square = p.grad.detach().double().pow(2).sum()
            if getattr(p, "allreduce", True):
                dense += square
            else:
                expert += square
    if ps.get_model_parallel_group() is not None and dist.is_initialized():
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        # dense models too (0 everywhere): a collective every rank of the group takes part in
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(float(dense + expert))


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-d bool tensor: whether every element of every tensor is finite.

    A sum is finite only if each of its summands is (a NaN or an infinity makes it NaN or
    infinite), so one reading pass per tensor settles the common case: ~28 ms for SmolLM2-135M's
    weights on 2 cores, where ``isfinite(t).all()`` makes four passes and a bool copy (~280 ms).
    A sum can also overflow from finite elements (beyond 3.4e38 in fp32); only then is every
    element checked, so the answer is always ``isfinite``'s.
    """
    if not tensors:
        return torch.tensor(True)
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(sums.isfinite().all()):
        return torch.tensor(True, device=sums.device)
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


class MegatronOptimizer(ActorOptimizer):
    """Megatron's (distributed) optimizer: fp32 main params and grads under bf16 params.

    With ``overlap_param_gather`` Megatron defers the parameter all-gather of the distributed
    optimizer to the next forward's pre-hooks; megarl exports weights to the rollout engine
    right after every step, so the gather is forced here (the exporter must read updated
    parameters). The flag then only changes *when* the gather's buckets are issued.
    """

    def __init__(
        self,
        chunks: list,
        cfg: ActorConfig,
        distributed: bool = False,
        overlap_param_gather: bool = False,
    ):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.chunks = chunks
        model = chunks[0]
        self.force_param_sync = distributed and overlap_param_gather
        config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.optim.weight_decay,
            adam_beta1=cfg.optim.betas[0],
            adam_beta2=cfg.optim.betas[1],
            adam_eps=cfg.optim.eps,
            clip_grad=cfg.optim.grad_clip,
            bf16=model.config.bf16,
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=distributed,
        )
        self.inner = get_megatron_optimizer(config, chunks)
        self.step_count = 0  # steps taken, restored from a checkpoint
        self._index = None  # model param -> where its state lives (built on first load)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    @torch.no_grad()
    def step(self) -> float:
        """Megatron's step (``ChainedOptimizer.step``) with the norm looked at before the update:
        Megatron's own applies a non-finite gradient (bf16 has no loss scaler to catch it) and
        reports no norm when clipping is off."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.inner.prepare_grads():  # an fp16 loss scaler found inf/nan: nothing applied
            return math.inf
        norm = float(self.inner.get_grad_norm())
        if not math.isfinite(norm):
            return norm
        for part in getattr(self.inner, "chained_optimizers", [self.inner]):
            if getattr(part, "is_stub_optimizer", False):  # a rank with nothing of that kind
                continue
            params = part.get_parameters()
            if part.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(params, part.config.clip_grad, norm)
        self.inner.step_with_ready_grads()
        self.step_count += 1
        if self.force_param_sync:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)
        return norm

    # --- per-parameter state for checkpoints (megarl.checkpoint) -----------------------------

    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's state shaped like it, with its fp32 main copy (``main_param``)
        under bf16; collective over the distributed optimizer's data-parallel groups, whose
        first ranks (the checkpoint's writers) get the parameters' full state
        (:mod:`megarl.actor.megatron_optim_state`)."""
        from megarl.actor.megatron_optim_state import gather_param_states

        return gather_param_states(self.inner, self.step_count)

    def reload_model_params(self) -> None:
        """Refresh the fp32 main copies from the model's weights (after a checkpoint load
        wrote them): Megatron's next step would otherwise overwrite the loaded weights with
        an update of the old main copies."""
        self.inner.reload_model_params()

    def load_param_state(self, param, state: dict[str, torch.Tensor]) -> None:
        from megarl.actor.megatron_optim_state import index_params, load_param_state

        if self._index is None:
            self._index = index_params(self.inner)
        target = self._index.get(param)
        if target is None:
            raise KeyError(
                f"the optimizer does not train a parameter of shape {tuple(param.shape)}"
            )
        load_param_state(target, param, state)
        self.step_count = int(state["step"].item())


def build_optimizer(chunks: list, cfg: ActorConfig, plan) -> ActorOptimizer:
    """The optimizer the execution plan names, over every model chunk (the DDP-wrapped
    virtual-pipeline chunks; one without a virtual pipeline)."""
    if plan.optimizer == "megatron":
        return MegatronOptimizer(
            chunks,
            cfg,
            distributed=plan.distributed_optimizer,
            overlap_param_gather=plan.overlap_param_gather,
        )
    return CpuAdamW(chunks, cfg)

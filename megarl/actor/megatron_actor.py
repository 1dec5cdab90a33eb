"""The Megatron-Core actor (and reference) on one rank: build, load, forward logprobs, train a plan.

This is the thin, device-facing layer. It decides nothing: which sequences go in which
micro-batch, what each optimizer step normalises by, and which passes run all come from pure
code (the batch planner and the gates); this class executes them with Megatron's pipeline
schedules and DDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist

from megarl.actor.router_stats import find_routers
from megarl.actor.routing_recorder import RoutingRecorder
from megarl.actor.train_stats import OptimizerStepStats, sum_micro_batches
from megarl.actor.training_loss import LossSettings, training_loss
from megarl.batch import (
    MicroBatchTensors,
    Rollouts,
    build_micro_batch,
    per_token_to_response,
)
from megarl.config.actor import ActorConfig
from megarl.distributed.batch_invariant import batch_invariant_mode
from megarl.distributed.execution import ExecutionPlan
from megarl.models import megatron_gpt
from megarl.models.spec import TransformerSpec
from megarl.models.vocab_parallel import VocabShard, token_logprobs_and_entropy
from megarl.planner.step_plan import MicroBatch, OptimizerStepPlan


@dataclass(frozen=True)
class TrainStepResult:
    """One optimizer step on this rank."""

    stats: OptimizerStepStats
    grad_norm: float
    """The global gradient norm (the same on every rank)."""
    train_logprobs: dict[int, torch.Tensor]
    """With ``capture_logprobs``: the detached training-forward logprobs of the trained
    sequences (the run checks them against the engine's); empty otherwise."""
    weights_finite: bool = True
    """Every rank's weights are finite after the step (checked over the world)."""


class MegatronActor:
    """A Megatron ``GPTModel`` shard with optional DDP + optimizer (``trainable``)."""

    def __init__(
        self,
        spec: TransformerSpec,
        cfg: ActorConfig,
        device: str,
        dtype: torch.dtype,
        hf_weights: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
        pad_id: int,
        trainable: bool = True,
        init_seed: int = 0,
        execution: ExecutionPlan | None = None,
        batch_invariant: bool = False,
    ):
        from megatron.core import parallel_state as ps

        self.spec, self.cfg, self.device, self.pad_id = spec, cfg, device, pad_id
        self.batch_invariant = batch_invariant
        """``rollout.batch_invariant``: every forward (logprobs and training) runs in
        :func:`megarl.distributed.batch_invariant.batch_invariant_mode`, so a token's logprob
        has the bits the Megatron engine's decode gave it."""
        self.execution = execution or default_execution(cfg, device)
        torch.manual_seed(init_seed)
        # --- virtual pipeline: the model is a list of chunks -------------------
        chunks = self._build_chunks(dtype, init_seed)
        if hf_weights is not None:
            megatron_gpt.load_hf_weights(chunks, spec, hf_weights)
        model = chunks[0]
        # --- LoRA (megarl.models.lora): adapters on frozen base weights, before DDP ---
        self.lora = None
        if trainable and cfg.lora.enabled:
            from megarl.models.lora import LoraSettings, apply_lora

            self.lora = LoraSettings.from_config(cfg.lora, seed=init_seed)
            apply_lora(model, spec, self.lora)
        self.is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        tp_rank = ps.get_tensor_model_parallel_rank()
        vocab_per_rank = spec.padded_vocab_size(cfg.tp) // cfg.tp
        self.vocab_shard = VocabShard(
            start=tp_rank * vocab_per_rank,
            real_vocab_size=spec.vocab_size,
            group=ps.get_tensor_model_parallel_group() if cfg.tp > 1 else None,
        )
        if trainable:
            chunks = self._wrap_ddp(chunks)
            self.model = chunks[0]
            self.chunks = chunks
            self.optimizer = self._build_optimizer()
        else:
            for chunk in chunks:
                chunk.eval()
                for p in chunk.parameters():
                    p.requires_grad_(False)
            self.model = model
            self.chunks = chunks
            self.optimizer = None
        """``chunks``: the model chunks in virtual-pipeline order (one unless ``actor.vpp > 1``),
        DDP-wrapped when trained; ``model``: the first of them."""
        routers = find_routers(self.chunks) if trainable and self._router_loss_on else []
        self.routers: list[Any] = list(routers)  # Megatron TopKRouters (untyped attributes)
        """The MoE routers whose load-balancing loss joins the gradient (none when it is off)."""
        split = ps.get_tensor_model_parallel_group() if self.sequence_split > 1 else None
        self.routing = (
            RoutingRecorder(self.chunks, spec.moe_top_k, split)
            if trainable and spec.is_moe
            else None
        )
        """Mixture-of-experts actors: records the routers' experts for the rank loop's check
        against the engine's (``rollout/moe_routing_mismatch``) and for R2; idle unless armed."""
        self.replay = None
        if trainable and self._replay_on:
            from megarl.actor.router_replay import RouterReplayer

            self.replay = RouterReplayer(self.chunks, spec.moe_top_k, split)
        """``actor.router_replay.mode`` R2/R3: replays the routing the rank loop arms it with;
        None otherwise."""
        for router in self.routers:
            # Megatron copies this flag from the config when the router is built, before
            # _wrap_ddp sets it: pin it, so router_loss_coeffs' scaling holds whatever the
            # construction order (it makes the router weigh its loss by its micro-batch's tokens)
            router.calculate_per_token_loss = True

    @property
    def sequence_split(self) -> int:
        """Into how many slices the TP ranks cut every micro-batch's sequence between the
        tensor-parallel blocks: ``actor.tp`` when the model runs sequence-parallel
        (:func:`megarl.models.megatron_gpt.uses_sequence_parallel`), else 1 (every TP rank
        holds the whole sequence)."""
        return self.cfg.tp if megatron_gpt.uses_sequence_parallel(self.spec, self.cfg.tp) else 1

    @property
    def length_multiple(self) -> int:
        """What every micro-batch's sequence dimension divides by: one slice per TP rank under
        sequence parallelism (:attr:`sequence_split`)."""
        return self.sequence_split

    @property
    def _replay_on(self) -> bool:
        return self.spec.is_moe and self.cfg.router_replay.mode != "disabled"

    @property
    def _router_loss_on(self) -> bool:
        return self.spec.is_moe and self.cfg.moe_aux_loss_coef > 0

    # --- construction ----------------------------------------------------------------------

    def _build_chunks(self, dtype: torch.dtype, init_seed: int) -> list:
        """This rank's model chunks, not yet loaded; the critic's carry its value head."""
        del init_seed  # every actor weight comes from the checkpoint; the head has its own seed
        return megatron_gpt.build_model_chunks(
            self.spec,
            self.cfg.tp,
            self.cfg.pp,
            self.cfg.vpp,
            dtype=dtype,
            device=self.device,
            use_transformer_engine=self.execution.use_transformer_engine,
            recompute=self.execution.recompute,
            moe_aux_loss_coef=self.cfg.moe_aux_loss_coef if self._router_loss_on else 0.0,
            moe_routing_replay=self._replay_on,
            **self._head_options(),
        )

    def _head_options(self) -> dict:
        """Extra ``build_model_chunks`` options: none for the actor (its output layer)."""
        return {}

    def _wrap_ddp(self, chunks: list) -> list:
        """Each chunk in Megatron's DDP (one gradient buffer each; as Megatron's own training
        does, only the first chunk's is bucketed)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = chunks[0].config
        config.calculate_per_token_loss = True  # we normalise explicitly; DDP must sum
        plan = self.execution
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=plan.grad_reduce_in_fp32,
            overlap_grad_reduce=plan.overlap_grad_reduce,
            overlap_param_gather=plan.overlap_param_gather,
            use_distributed_optimizer=plan.distributed_optimizer,
        )
        wrapped = [
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(chunks)
        ]
        if plan.overlap_grad_reduce:
            # Megatron's schedules only defer the bucketed reduce to the last micro-batch
            # (and start it early in pipelined schedules) through these config hooks.
            no_sync = [ddp.no_sync for ddp in wrapped]
            grad_sync = [ddp.start_grad_sync for ddp in wrapped]
            config.no_sync_func = no_sync[0] if len(wrapped) == 1 else no_sync
            config.grad_sync_func = grad_sync[0] if len(wrapped) == 1 else grad_sync
        return wrapped

    def _build_optimizer(self):
        from megarl.actor.optim import build_optimizer

        return build_optimizer(self.chunks, self.cfg, self.execution)

    def _micro_batch(
        self,
        batch: Rollouts,
        seq_indices: Sequence[int],
        loss_weights: Sequence[float] | None = None,
    ) -> MicroBatchTensors:
        """Packed or padded per the execution plan, on this rank's device."""
        mb = build_micro_batch(
            batch,
            seq_indices,
            self.pad_id,
            loss_weights,
            packed=self.execution.pack_sequences,
            length_multiple=self.length_multiple,
        )
        return mb.to(self.device)

    def _logprobs_and_entropy(
        self, logits, mb: MicroBatchTensors, temperature: float, with_entropy: bool
    ):
        """Chunked vocab-parallel logprobs/entropy, mapped to per-sequence rows ``[B, L]``."""
        logp, entropy = token_logprobs_and_entropy(
            logits,
            mb.labels_BL,
            self.vocab_shard,
            temperature,
            with_entropy=with_entropy,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
        )
        return mb.to_rows(logp), (mb.to_rows(entropy) if entropy is not None else None)

    # --- forward-only logprobs ---------------------------------------------------------------

    def compute_logprobs(
        self,
        batch: Rollouts,
        micro_batches: Sequence[Sequence[int]],
        temperature: float,
        *,
        without_adapters: bool = False,
    ) -> dict[int, torch.Tensor]:
        """Per-token response logprobs of the planned micro-batches; empty off the last stage.

        ``without_adapters``: the LoRA actor's frozen base model (the reference policy)."""
        if not micro_batches:
            return {}
        mbs = [self._micro_batch(batch, group) for group in micro_batches]
        collect = partial(self._collect_logprobs_loss, batch=batch, temperature=temperature)
        with torch.no_grad(), self._adapters_off(without_adapters):
            outputs = self._run_schedule(mbs, collect, forward_only=True)
        result: dict[int, torch.Tensor] = {}
        for out in outputs:
            result.update(out["logprobs"])
        return result

    def _adapters_off(self, wanted: bool):
        if not wanted:
            return contextlib.nullcontext()
        if self.lora is None:
            raise ValueError("without_adapters: this actor has no LoRA adapters")
        from megarl.models.lora import adapters_disabled

        return adapters_disabled(self.model)

    def _collect_logprobs_loss(self, mb: MicroBatchTensors, logits, *, batch, temperature):
        logp_BL, _ = self._logprobs_and_entropy(logits, mb, temperature, with_entropy=False)
        zero = logits.new_zeros(())
        return zero, torch.tensor(1), {"logprobs": per_token_to_response(logp_BL, mb, batch)}

    # --- training ----------------------------------------------------------------------------

    def train_step(
        self,
        batch: Rollouts,
        step: OptimizerStepPlan,
        dp_rank: int,
        old_logprobs: Mapping[int, torch.Tensor] | None,
        ref_logprobs: Mapping[int, torch.Tensor] | None,
        loss: LossSettings,
        capture_logprobs: bool = False,
        token_advantages: Mapping[int, torch.Tensor] | None = None,
        before_update: Callable[[dict[int, torch.Tensor]], None] | None = None,
    ) -> TrainStepResult:
        """Run ``step``'s micro-batches for DP rank ``dp_rank`` and take the optimizer step.

        ``old_logprobs`` missing a sequence means "on-policy": the training forward's own
        detached logprobs serve as old logprobs (the gate decided the separate pass was waste).
        With ``capture_logprobs`` the detached training-forward logprobs of the trained
        sequences come back in the result. ``token_advantages`` (a critic's GAE, per response
        token of every sequence this rank runs) replace the batch's per-sequence advantages.
        ``before_update``: see :meth:`_optimizer_step`.
        """
        step_loss = partial(
            training_loss,
            batch=batch,
            old=old_logprobs or {},
            ref=ref_logprobs,
            loss=loss,
            denom=step.normaliser,
            capture=capture_logprobs,
            token_advantages=token_advantages,
        )
        loss_fn = partial(self._training_loss, step_loss, loss.temperature)
        stats, grad_norm = self._optimizer_step(
            batch, step, dp_rank, loss_fn, router_loss=True, before_update=before_update
        )
        result = _step_result(stats, grad_norm)
        return dataclasses.replace(result, weights_finite=self._weights_finite())

    def _optimizer_step(
        self,
        batch: Rollouts,
        step: OptimizerStepPlan,
        dp_rank: int,
        loss_fn: Callable,
        router_loss: bool = False,
        before_update: Callable[[dict[int, torch.Tensor]], None] | None = None,
    ) -> tuple[list[dict[str, Any]], float]:
        """One optimizer step of any loss (the policy's, the critic's values'): ``step``'s
        micro-batches for DP rank ``dp_rank`` through ``loss_fn`` (none for a ghost step, whose
        zero gradients still advance the optimizer as in the unpruned run), then the update.
        Returns each micro-batch's statistics (none off the last pipeline stage) and the
        gradient norm; ``router_loss``: weigh each micro-batch's MoE auxiliary loss.
        ``before_update`` (collective: every rank calls it) is handed the captured logprobs
        after the gradients are final and before the optimizer moves any weight: raising there
        leaves the weights as they were (the logprob guard, :mod:`megarl.planner.logprob_guard`)."""
        if self.optimizer is None:
            raise RuntimeError("training a frozen model (built with trainable=False)")
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        stats: list[dict[str, Any]] = []
        micro_batches = step.ranks[dp_rank].micro_batches
        if not step.is_ghost and micro_batches:
            mbs = [self._micro_batch(batch, m.seq_indices, m.loss_weights) for m in micro_batches]
            coeffs = self.router_loss_coeffs(mbs, micro_batches) if router_loss else None
            stats = self._run_schedule(mbs, loss_fn, forward_only=False, router_coeffs=coeffs)
        self._finalize_grads()
        if before_update is not None:
            before_update(
                {i: lp for entry in stats for i, lp in entry.get("train_logprobs", {}).items()}
            )
        return stats, float(self.optimizer.step())

    def _weights_finite(self) -> bool:
        """Whether every trainable weight of every rank is finite (one MIN all-reduce): an
        update must never reach the engine or a checkpoint with inf or NaN in it."""
        from megarl.actor.optim import all_finite

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        local = all_finite(
            [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]
        )
        flag = local.to(device=device, dtype=torch.float32).reshape(1)  # one sync, not per weight
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item() > 0)

    def router_loss_coeffs(
        self, mbs: Sequence[MicroBatchTensors], planned: Sequence[MicroBatch]
    ) -> list[float] | None:
        """Megatron's ``moe_aux_loss_coeff`` for each of this rank's micro-batches of one
        optimizer step (None when ``actor.moe_aux_loss_coef`` is 0 or the model is dense).

        What joins the gradient is ``coef x sum_mb T_mb aux_mb / T``: the Switch loss
        ``aux_mb`` of every micro-batch of the step on every DP rank (Megatron's ``aux_loss``:
        each micro-batch's own expert shares and mean probabilities, each layer's router adding
        its own, so summed over layers as in Megatron), weighted by its routed
        tokens ``T_mb`` over the step's routed tokens ``T`` -- a token-weighted mean, so
        ``coef`` means what it means in Megatron pretraining and ``actor/moe_aux_loss``
        (1.0 when balanced) is on the same scale, whatever the DP size, the micro-batch
        count or the planner's normaliser of the policy loss.

        How Megatron 0.16.1 gets there. The router attaches ``coeff x aux_mb`` to its output
        through ``MoEAuxLossAutoScaler``, whose backward injects the gradient of that term
        times a scale the schedule sets after each forward: 1 under
        ``calculate_per_token_loss`` (which megarl sets: the policy loss divides by the
        planner's fixed normaliser, DDP sums over DP ranks, and ``finalize_model_grads`` is
        called without a token count, so nothing divides afterwards). With per-token loss the
        router also multiplies ``aux_mb`` by its ``T_mb`` (Megatron expects a later division
        by the global token count, which megarl's normalisation never does). Micro-batch
        gradients and DP ranks then add up. So the per-micro-batch coefficient is
        ``coef / T``, with ``T`` summed over the DP group (one scalar all-reduce per step);
        the policy loss is untouched. A filler micro-batch (loss weight 0, only there to give
        ranks equal counts) gets 0: its tokens are no training data, so they must not pull the
        router either.

        Sequence-parallel (MoE under TP), each TP rank's router sees ``1/tp`` of the
        micro-batch: Megatron sums the expert counts over the TP group, so each rank's
        ``aux_mb`` is its slice's share of the whole micro-batch's loss, but it multiplies that
        by the slice's ``T_mb / tp`` tokens, so the router gradients summed over TP carry
        ``T_mb / tp x aux_mb``. The coefficient is therefore ``tp x coef / T`` there (``T`` and
        ``T_mb`` count the padding to a multiple of TP, which Megatron routes and counts too).

        What it is not: one loss over the whole step's tokens (Megatron's ``global_aux_loss``).
        The micro-batch grouping (``actor.micro_batch_tokens``, the DP split) therefore changes
        the loss a little, as in Megatron.
        """
        if not self.routers:
            return None
        from megatron.core import parallel_state as ps

        trained = [m.num_trained > 0 for m in planned]
        local = sum(mb.tokens_BL.numel() for mb, keep in zip(mbs, trained, strict=True) if keep)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor([float(local)], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        coef = self.cfg.moe_aux_loss_coef * self.sequence_split / float(total.item())
        return [coef if keep else 0.0 for keep in trained]

    def _set_router_coeff(self, coeff: float) -> None:
        """Every router reads ``config.moe_aux_loss_coeff`` on each training forward."""
        for router in self.routers:
            router.config.moe_aux_loss_coeff = coeff

    def _training_loss(
        self,
        step_loss: Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
        temperature: float,
        mb: MicroBatchTensors,
        logits,
    ):
        """The micro-batch's logprobs and entropy from the model's logits, then ``step_loss``
        (:func:`~megarl.actor.training_loss.training_loss` bound to the step's inputs) of them."""
        logp_BL, entropy_BL = self._logprobs_and_entropy(logits, mb, temperature, with_entropy=True)
        assert entropy_BL is not None  # asked for with_entropy=True
        return step_loss(logp_BL, entropy_BL, mb)

    def _finalize_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.chunks)

    # --- schedule ----------------------------------------------------------------------------

    def _run_schedule(
        self,
        mbs: list[MicroBatchTensors],
        loss_fn,
        forward_only: bool,
        router_coeffs: Sequence[float] | None = None,
    ) -> list:
        """Megatron's forward(-backward) schedule over ``mbs``; ``router_coeffs``: each
        micro-batch's router load-balancing coefficient (:meth:`router_loss_coeffs`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            if router_coeffs is not None:
                self._set_router_coeff(router_coeffs[index])
            with self._routing_of(mb):
                output = model(
                    mb.tokens_BL, mb.position_ids_BL, None, packed_seq_params=packed_seq_params(mb)
                )
            return output, partial(loss_fn, mb)

        max_len = max(mb.tokens_BL.shape[1] for mb in mbs)
        max_b = max(mb.tokens_BL.shape[0] for mb in mbs)
        if len(self.chunks) > 1:  # interleaved: one activation shape for every micro-batch
            mbs = [
                mb
                if tuple(mb.tokens_BL.shape) == (max_b, max_len)
                else mb.with_packed_width(max_len, self.pad_id)  # refuses other padded shapes
                for mb in mbs
            ]
        # each virtual-pipeline chunk walks the micro-batches on its own
        walks: list[Iterator[tuple[int, MicroBatchTensors]]] = [
            iter(enumerate(mbs)) for _ in self.chunks
        ]
        data = walks[0] if len(walks) == 1 else walks
        with batch_invariant_mode(self.batch_invariant):
            return (
                get_forward_backward_func()(
                    forward_step_func=forward_step,
                    data_iterator=data,
                    model=cast("list[torch.nn.Module]", self.chunks),
                    num_microbatches=len(mbs),
                    seq_length=max_len,
                    micro_batch_size=max_b,
                    forward_only=forward_only,
                )
                or []
            )

    @contextlib.contextmanager
    def _routing_of(self, mb: MicroBatchTensors):
        """The router replay's and the routing recorder's scope for one forward (no-ops for
        dense models, and while the rank loop has armed neither)."""
        with contextlib.ExitStack() as scopes:
            if self.replay is not None:
                scopes.enter_context(self.replay.forward(mb))
            if self.routing is not None:
                scopes.enter_context(self.routing.forward(mb))
            yield

    # --- weights -----------------------------------------------------------------------------

    def local_params(self) -> Iterable:
        """``(rule, global_layer, param)`` for this rank's shards (the exporter reads these)."""
        return megatron_gpt.iter_local_params(self.chunks, self.spec)

    def gather_lora_adapter(self) -> dict[str, torch.Tensor] | None:
        """The LoRA adapter under peft's HF names on global rank 0 (a collective)."""
        from megarl.export.lora import gather_peft_adapter

        return gather_peft_adapter(self.model, self.spec)


def default_execution(cfg: ActorConfig, device: str) -> ExecutionPlan:
    """The plan for ``device`` on this machine when the caller did not decide one."""
    from megarl.distributed.execution import ExecutionRequest, decide_execution, detect_environment

    return decide_execution(ExecutionRequest.for_actor(cfg, device), detect_environment())


def packed_seq_params(mb: MicroBatchTensors):
    """Megatron's THD ``PackedSeqParams`` for a packed micro-batch (None when padded).

    The same object drives RoPE (positions restart at each ``cu_seqlens`` boundary) and the
    attention core (TE's fused THD attention on GPU, per-block SDPA otherwise).
    """
    if mb.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds, longest = list(mb.cu_seqlens), mb.max_seqlen
    width = int(mb.tokens_BL.shape[1])
    if bounds[-1] < width:  # a padding tail (sequence parallelism): a segment of its own
        bounds.append(width)
        longest = max(longest, width - bounds[-2])
    cu = torch.tensor(bounds, dtype=torch.int32, device=mb.tokens_BL.device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def _step_result(per_micro_batch: list[dict], grad_norm: float) -> TrainStepResult:
    """Sum the micro-batches' statistics (none on non-last pipeline stages)."""
    captured: dict[int, torch.Tensor] = {}
    for entry in per_micro_batch:
        captured.update(entry.pop("train_logprobs", {}))
    totals = sum_micro_batches(OptimizerStepStats, per_micro_batch)
    return TrainStepResult(stats=totals, grad_norm=grad_norm, train_logprobs=captured)


def reduce_max_to_all(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of per-rank values over the whole world (replicas change nothing)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def reduce_sums_to_all(rows: Sequence[Sequence[float]], tp: int) -> list[list[float]]:
    """Sum equal-length rows of per-rank statistics over the whole world in one all-reduce;
    the ``tp`` TP replicas of a value each hold it, so it is counted once."""
    if not rows:
        return []
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    tensor = torch.tensor([list(r) for r in rows], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / tp).cpu().tolist()

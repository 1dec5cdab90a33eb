"""The Megatron critic on one rank: values of a rollout's tokens, and the clipped value-loss update.

The critic is the actor's architecture with a scalar value head (:mod:`megarl.models.value_head`),
built on the same TP/PP layout and ranks, loaded from the same HF checkpoint (the head is
initialised) or from ``critic.model.path`` (a folder of the same architecture, whose scalar
``score`` head is loaded when it has one; :mod:`megarl.critic.model_source`), and trained by
its own optimizer. It reuses the actor's construction,
DDP wrapping, micro-batch building and pipeline schedule (hence the subclass); only its two
passes differ: :meth:`MegatronCritic.compute_values` instead of logprobs, and
:meth:`MegatronCritic.train_values` with :func:`megarl.algo.gae.value_loss` instead of the
policy loss. Like the actor it decides nothing: which sequences form each micro-batch and what
each optimizer step normalises by come from the batch planner.

Values line up with logprobs: the value of response token ``t`` is the model's output at the
position *before* it (the state from which the token was sampled), which is where the logprob
of token ``t`` is read too, so :func:`megarl.batch.per_token_to_response` cuts both alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from megarl.actor.megatron_actor import MegatronActor
from megarl.actor.train_stats import sum_micro_batches
from megarl.algo.gae import value_loss
from megarl.batch import MicroBatchTensors, Rollouts, per_token_to_response, response_values_to_BL
from megarl.config.actor import ActorConfig
from megarl.critic.value_stats import CriticStepStats
from megarl.distributed.execution import ExecutionPlan
from megarl.models.megatron_gpt import ValueHeadInit
from megarl.models.spec import TransformerSpec
from megarl.planner.step_plan import OptimizerStepPlan


@dataclass(frozen=True)
class ValueLossSettings:
    """The critic's loss keys (verl's ``critic.cliprange_value``, the actor's aggregation)."""

    cliprange_value: float = 0.5
    agg: str = "token-mean"
    loss_scale_factor: float | None = None


@dataclass(frozen=True)
class CriticStepResult:
    """One critic optimizer step on this rank."""

    stats: CriticStepStats
    grad_norm: float
    """The global gradient norm (the same on every rank)."""


class MegatronCritic(MegatronActor):
    """A Megatron value model shard with DDP and its own optimizer (``cfg.lr``, ``cfg.optim``)."""

    def __init__(
        self,
        spec: TransformerSpec,
        cfg: ActorConfig,
        device: str,
        dtype: torch.dtype,
        hf_weights: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor],
        pad_id: int,
        head: ValueHeadInit | None = None,
        execution: ExecutionPlan | None = None,
    ):
        if cfg.lora.enabled:
            raise ValueError("the critic trains all of its weights: LoRA is not supported for it")
        self.head = head or ValueHeadInit()
        super().__init__(
            spec, cfg, device, dtype, hf_weights, pad_id, trainable=True, execution=execution
        )

    def _head_options(self) -> dict:
        """A scalar value head instead of the vocabulary output layer (its draw has its own
        seed, ``ValueHeadInit.seed``)."""
        return {"value_head": self.head}

    def value_head_param(self) -> torch.nn.Parameter | None:
        """The value head's weight on the last pipeline stage; None on the others."""
        from megarl.models.value_head import is_value_head_param_name

        for name, param in self.model.named_parameters():
            if is_value_head_param_name(name):
                return param
        return None

    # --- values ------------------------------------------------------------------------------

    def compute_values(
        self, batch: Rollouts, micro_batches: Sequence[Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        """Per-response-token values of the planned micro-batches; empty off the last stage."""
        if not micro_batches:
            return {}
        mbs = [self._micro_batch(batch, group) for group in micro_batches]
        with torch.no_grad():
            collect = partial(self._collect_values, batch=batch)
            outputs = self._run_schedule(mbs, collect, forward_only=True)
        result: dict[int, torch.Tensor] = {}
        for out in outputs:
            result.update(out["values"])
        return result

    @staticmethod
    def _values_BL(mb: MicroBatchTensors, output: torch.Tensor) -> torch.Tensor:
        """The model's ``[B, L, 1]`` (packed: ``[1, T, 1]``) output as one row per sequence."""
        return mb.to_rows(output[..., 0].float())

    def _collect_values(self, mb: MicroBatchTensors, output, *, batch):
        values = per_token_to_response(self._values_BL(mb, output), mb, batch)
        return output.new_zeros(()), torch.tensor(1), {"values": values}

    # --- training ----------------------------------------------------------------------------

    def train_values(
        self,
        batch: Rollouts,
        step: OptimizerStepPlan,
        dp_rank: int,
        old_values: Mapping[int, torch.Tensor],
        returns: Mapping[int, torch.Tensor],
        loss: ValueLossSettings,
    ) -> CriticStepResult:
        """Run ``step``'s micro-batches for DP rank ``dp_rank`` on the clipped value loss
        against ``returns`` (clipped around ``old_values``, the rollout's), then step."""
        loss_fn = partial(
            self._value_loss,
            batch=batch,
            old_values=old_values,
            returns=returns,
            loss=loss,
            denom=step.normaliser,
        )
        stats, grad_norm = self._optimizer_step(batch, step, dp_rank, loss_fn)
        return CriticStepResult(sum_micro_batches(CriticStepStats, stats), grad_norm)

    def _value_loss(
        self,
        mb: MicroBatchTensors,
        output,
        *,
        batch,
        old_values,
        returns,
        loss: ValueLossSettings,
        denom: float,
    ):
        vpreds_BL = self._values_BL(mb, output)
        mask_BL = mb.loss_mask_BL
        out = value_loss(
            vpreds_BL,
            response_values_to_BL({i: old_values[i] for i in mb.seq_indices}, mb, batch),
            response_values_to_BL({i: returns[i] for i in mb.seq_indices}, mb, batch),
            mask_BL,
            loss.cliprange_value,
            loss.agg,
            denom=denom,
            loss_scale_factor=loss.loss_scale_factor,
        )
        num_tokens = mask_BL.gt(0).sum()
        stats = {
            "vf_loss": out.loss.detach(),
            "vf_clipfrac_sum": out.clipfrac * num_tokens,
            "vpred_sum": out.vpred_mean * num_tokens,
            "num_tokens": num_tokens.float(),
        }
        return out.loss, num_tokens, stats

    # --- the actor's passes do not apply -----------------------------------------------------

    def compute_logprobs(self, *args, **kwargs):
        raise TypeError("a critic has no logprobs: use compute_values")

    def train_step(self, *args, **kwargs):
        raise TypeError("a critic has no policy loss: use train_values")

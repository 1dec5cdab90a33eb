"""The actor's update: every optimizer step of the plan, and the step's statistics.

Each optimizer step runs this rank's micro-batches of the plan (:mod:`megarl.planner`); the
loss (policy loss, rollout correction, KL, entropy) is :class:`LossSettings` from the config.
The first optimizer step's training forward also checks the engine: its logprobs (and, for a
mixture-of-experts model, its routing) of the sequences the old-logprob pass did not recompute
are the trainer's own under the weights the step starts from. Only sequences those weights
sampled are compared with the engine's (``rollout/logprob_abs_diff``): a stale sequence's
(asynchronous training) differ by the policy's drift too, which ``rollout_corr/*`` measures
and the correction weighs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from megarl.actor.megatron_actor import reduce_max_to_all, reduce_sums_to_all
from megarl.actor.train_stats import OptimizerStepStats, UpdateStats, summarise_update
from megarl.actor.training_loss import LossSettings
from megarl.algo.covariance import CovarianceRule
from megarl.algo.divergence import (
    DivergenceError,
    DivergenceHints,
    is_nonfinite,
    nonfinite_grad_message,
    nonfinite_weights_message,
)
from megarl.algo.m2po import SecondMomentRule
from megarl.algo.rollout_correction import MismatchStats, mismatch_stats_of_sequences
from megarl.algo.router_replay import replay_plan
from megarl.algo.routing_mismatch import RoutingMismatch
from megarl.batch import response_mask
from megarl.config.schema import RunConfig
from megarl.distributed import heartbeat
from megarl.planner.step_plan import StepPlan
from megarl.trainer import moe_routing
from megarl.trainer.engine_guard import NOT_APPLIED
from megarl.trainer.runtime import pipeline_group

if TYPE_CHECKING:
    from megarl.batch import Rollouts, RolloutShard
    from megarl.trainer.logprob_passes import StepLogprobs
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.runtime import Runtime


def loss_settings(cfg: RunConfig) -> LossSettings:
    a = cfg.actor
    return LossSettings(
        temperature=cfg.rollout.temperature,
        clip_low=a.clip_ratio_low,
        clip_high=a.clip_ratio_high,
        agg=cfg.loss_agg,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        policy_loss=a.policy_loss,
        clip_ratio_c=a.clip_ratio_c,
        loss_scale_factor=cfg.loss_scale_factor,
        rollout_correction=cfg.algo.rollout_correction.settings,
        echo_coef=a.echo_coef,
        loss_keys=a.loss_keys,
    )


def update_actor(
    rt: Runtime,
    batch: RolloutShard,
    plan: StepPlan,
    logprobs: StepLogprobs,
    timer: PhaseTimer,
    token_advantages: dict[int, torch.Tensor] | None = None,
    stale: frozenset[int] = frozenset(),
    step: int = 0,
    token_rule: CovarianceRule | SecondMomentRule | None = None,
) -> UpdateStats:
    """Every optimizer step of the plan on this rank's micro-batches; the step's statistics,
    each the mean over optimizer steps. ``token_advantages``: a critic's, per token;
    ``stale``: the sequences older weights sampled (left out of the engine check);
    ``token_rule``: clip_cov / kl_cov's or m2po's rule of the step (fitted over the whole
    batch, :mod:`megarl.trainer.token_rules`).

    The engine check (logprobs, ``rollout_corr/*``, MoE routing) compares the first forward of
    each trained sequence on the weights the step starts from: the old-logprob pass's where the
    gates ran it, else the first optimizer step's training forward, which also runs before any
    weight moves.
    """
    loss = dataclasses.replace(loss_settings(rt.cfg), token_rule=token_rule)
    per_step: list[OptimizerStepStats] = []
    grad_norms: list[float] = []
    lp_diff = [0.0, 0.0]  # |engine - trainer| summed, tokens compared
    mismatch = MismatchStats()  # rollout_corr/*: the same tokens, old vs engine
    stage_routing = None  # rollout/moe_routing_mismatch*: the same tokens' experts
    num_steps = len(plan.optimizer_steps)
    trained = plan.trained_sequences(rt.dp_rank)
    replay = replay_plan(rt.cfg.actor.router_replay.mode)
    replayed = moe_routing.training_replay(rt.actor, batch, replay, trained, logprobs.routing)
    with timer.phase("update_actor"):
        for index, opt_step in enumerate(plan.optimizer_steps):
            heartbeat.mark("update_actor")  # each optimizer step is progress
            rt.progress("update_actor", index, num_steps, "optimizer steps")
            with (
                moe_routing.recording(rt.actor, batch, on=index == 0) as train_routing,
                moe_routing.replaying(rt.actor, replayed),
            ):
                result = rt.actor.train_step(
                    batch,
                    opt_step,
                    rt.dp_rank,
                    logprobs.old,
                    logprobs.ref,
                    loss,
                    capture_logprobs=index == 0,
                    token_advantages=token_advantages,
                    **_guarded(rt, batch, logprobs, stale, step, first=index == 0),
                )
            check_update(rt.cfg, step, index, result)
            per_step.append(result.stats if rt.actor.is_last_stage else OptimizerStepStats())
            grad_norms.append(result.grad_norm)
            if index == 0 and rt.actor.is_last_stage:
                trainer_logprobs = {**result.train_logprobs, **logprobs.recomputed}
                lp_diff = logprob_diff(batch, _without(trainer_logprobs, stale))
                mismatch = mismatch_stats_of_sequences(
                    trainer_logprobs,
                    batch.engine_logprobs,
                    loss.rollout_correction,
                    masks=batch.response_masks,
                )
            if index == 0:  # every pipeline stage compares the experts of its own layers
                routing = _without({**train_routing, **logprobs.routing}, stale)
                stage_routing = moe_routing.compare_with_engine(rt.actor, batch, routing)
        rt.progress("update_actor", num_steps, num_steps, "optimizer steps")
    return _reduce_update_stats(rt, per_step, grad_norms, lp_diff, mismatch, stage_routing)


def _guarded(
    rt: Runtime,
    batch: RolloutShard,
    logprobs: StepLogprobs,
    stale: frozenset[int],
    step: int,
    first: bool,
) -> dict:
    """The first optimizer step's ``before_update``: the logprob guard's step check
    (:mod:`megarl.trainer.engine_guard`) on the same tokens ``rollout/logprob_abs_diff``
    compares, decided before any weight moves; nothing when the guard is off."""
    if rt.guard is None or not rt.guard.step_check or not first:
        return {}
    guard = rt.guard

    def check(captured: dict[int, torch.Tensor]) -> None:
        local = [0.0, 0.0]
        if rt.actor.is_last_stage:
            local = logprob_diff(batch, _without({**captured, **logprobs.recomputed}, stale))
        guard.check(f"step {step}", local, rt.cfg.actor.tp, NOT_APPLIED)

    return {"before_update": check}


def check_update(cfg: RunConfig, step: int, index: int, result) -> None:
    """Divergence is named where it happens (:mod:`megarl.algo.divergence`): weights that an
    update left non-finite stop the run; so does a non-finite gradient norm (its update was not
    applied) unless ``trainer.skip_nonfinite_updates`` lets training go on. Every rank sees the
    same norm and the same world-wide weight check, so all stop together."""
    hints = DivergenceHints(cfg.actor.lr, cfg.actor.optim.grad_clip)
    if not result.weights_finite:
        raise DivergenceError(nonfinite_weights_message(step, index, hints))
    if is_nonfinite(result.grad_norm) and not cfg.trainer.skip_nonfinite_updates:
        raise DivergenceError(nonfinite_grad_message(step, index, result.grad_norm, hints))


def _reduce_update_stats(
    rt: Runtime,
    per_step: list[OptimizerStepStats],
    grad_norms: list[float],
    lp_diff: list[float],
    mismatch: MismatchStats,
    stage_routing,
) -> UpdateStats:
    """This rank's sums, reduced over the ranks: the step's ``actor/*``, ``rollout/*`` and
    ``rollout_corr/*`` statistics."""
    tp = rt.cfg.actor.tp
    global_steps = [
        OptimizerStepStats.from_row(row)
        for row in reduce_sums_to_all([s.to_row() for s in per_step], tp)
    ]
    routing = moe_routing.stage_mismatch(
        stage_routing, pipeline_group(rt.cfg.actor.pp), rt.cfg.actor.pp, rt.actor.is_last_stage
    )
    num_routing = len(routing.to_row())
    [[lp_diff_sum, lp_diff_count, *sums]] = reduce_sums_to_all(
        [lp_diff + mismatch.to_row() + routing.to_row()], tp
    )
    mismatch_sums, routing_sums = sums[:-num_routing], sums[-num_routing:]
    mismatch = MismatchStats.from_row(mismatch_sums, reduce_max_to_all(mismatch.max_row()))
    return summarise_update(
        global_steps,
        grad_norms,
        lp_diff_sum,
        lp_diff_count,
        mismatch.metrics(),
        RoutingMismatch.from_row(routing_sums).metrics(),
        echo=rt.cfg.actor.echo_coef > 0,
    )


def _without(per_sequence: dict, sequences: frozenset[int]) -> dict:
    return {i: value for i, value in per_sequence.items() if i not in sequences}


def logprob_diff(batch: Rollouts, trainer_logprobs: dict) -> list[float]:
    """Engine vs trainer logprobs of the same tokens under the same (generating) weights:
    the summed absolute difference and the number of tokens compared (the generated ones: an
    observation token of a multi-turn trajectory has no engine logprob)."""
    diff_sum, count = 0.0, 0
    for i, logp in trainer_logprobs.items():
        diff = (logp.float() - batch.engine_logprobs[i]).abs()
        mask = response_mask(batch, i)
        if mask is not None:
            diff = diff[mask > 0]
        diff_sum += float(diff.sum())
        count += diff.numel()
    return [diff_sum, float(count)]

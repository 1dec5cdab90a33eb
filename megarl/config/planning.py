"""Translate a :class:`RunConfig` (and a step's batch facts) into planner and gate inputs.

Pure: the CLI's start-up validation and every rank's step loop build their planner inputs and
gate facts here, so both agree on what the config means and no rank re-derives a rule inline.
It lives with the config, which the planner never imports: the planner knows only its own
inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

from megarl.algo.policy_losses import SECOND_MOMENT_LOSSES, ClipSettings, zero_advantage_term
from megarl.config.schema import RunConfig
from megarl.planner.gates import OldLogProbMode, RefLogProbMode, RunFacts, StepFacts
from megarl.planner.inputs import LossTerms, PlannerInputs
from megarl.planner.optimizer_steps import mini_batch_slices
from megarl.planner.pruning import resolve_prune_mode
from megarl.planner.staleness import trainer_version
from megarl.planner.step_plan import StepPlan

if TYPE_CHECKING:  # the batch types carry tensors; planning reads only their sizes
    from megarl.batch import RolloutBatch, RolloutShard


def prune_mode(cfg: RunConfig) -> tuple[str, str]:
    """The planner mode ``planner.prune_zero_adv`` resolves to, and why (``auto``: see
    :func:`~megarl.planner.pruning.resolve_prune_mode`)."""
    return resolve_prune_mode(cfg.planner.prune_zero_adv, loss_terms(cfg))


def loss_terms(cfg: RunConfig) -> LossTerms:
    """The actor's loss terms that decide whether pruning is exact, as the config sets them."""
    return LossTerms(
        kl_coef=cfg.actor.kl_coef,
        entropy_coef=cfg.actor.entropy_coef,
        adv_estimator=cfg.algo.adv_estimator,
        moe_aux_loss_coef=cfg.actor.moe_aux_loss_coef,
        echo_coef=cfg.actor.echo_coef,
        loss_term=policy_loss_term(cfg),
    )


def policy_loss_term(cfg: RunConfig) -> str | None:
    """Why ``actor.policy_loss`` with its keys acts on zero-advantage tokens (None: it does
    not, the usual case): see :func:`megarl.algo.policy_losses.zero_advantage_term`."""
    settings = ClipSettings(
        low=cfg.actor.clip_ratio_low,
        high=cfg.actor.clip_ratio_high,
        ratio_c=cfg.actor.clip_ratio_c,
        **cfg.actor.loss_keys,
    )
    return zero_advantage_term(cfg.actor.policy_loss, settings)


def run_facts(cfg: RunConfig) -> RunFacts:
    """The gates' run-wide facts: start-up validates forced modes and decides the reference
    source from them, and every step's :class:`StepFacts` carries them."""
    return RunFacts(
        ppo_mini_batches=cfg.actor.ppo_mini_batches,
        ppo_epochs=cfg.actor.ppo_epochs,
        total_steps=cfg.trainer.total_steps,
        old_log_prob=old_log_prob_mode(cfg),
        ref_log_prob=RefLogProbMode(cfg.planner.ref_log_prob),
        kl_coef=cfg.actor.kl_coef,
        kl_in_reward=cfg.algo.use_kl_in_reward,
        lora_enabled=cfg.actor.lora.enabled,
        rollout_correction=cfg.algo.rollout_correction.enabled,
        router_replay_r2=cfg.actor.router_replay.mode == "R2",
        rollout_engine=not cfg.algo.is_sft,
        distill=cfg.algo.distill.enabled,
        proximal_before_split=cfg.actor.policy_loss in SECOND_MOMENT_LOSSES,
        engine_is_actor=cfg.rollout.engine_is_actor,
    )


def old_log_prob_mode(cfg: RunConfig) -> OldLogProbMode:
    """``planner.old_log_prob``, or ``rollout`` (the behaviour logprobs as old) under
    ``algo.rollout_correction.bypass_mode``, its spelling in verl's keys."""
    if cfg.algo.rollout_correction.bypass_mode:
        return OldLogProbMode.ROLLOUT
    return OldLogProbMode(cfg.planner.old_log_prob)


def step_facts(
    cfg: RunConfig,
    step: int,
    num_sequences: int,
    engine_base_weights_resident: bool | None = None,
    plan: StepPlan | None = None,
    behaviour_versions: Sequence[int] | None = None,
) -> StepFacts:
    """The gates' view of one step: the slices are what each optimizer step consumes.

    Those are the baseline mini-batches, unless ``plan`` (this step's :class:`StepPlan`) merged
    them (``planner.prune_zero_adv=fast``): then the merged runs are the slices, so a sequence
    trained before the rollout's first optimizer step is not recomputed just because the
    unmerged schedule would have trained it later. ``behaviour_versions``: each sequence's
    oldest (:attr:`RolloutShard.oldest_versions`), against the step's trainer version.
    """
    return StepFacts(
        run=run_facts(cfg),
        step=step,
        slices=executed_slices(cfg, num_sequences, plan),
        engine_base_weights_resident=engine_base_weights_resident,
        behaviour_versions=None if behaviour_versions is None else tuple(behaviour_versions),
        trainer_version=trainer_version(step),
    )


def executed_slices(
    cfg: RunConfig, num_sequences: int, plan: StepPlan | None = None
) -> tuple[tuple[int, ...], ...]:
    """The sequences of each optimizer step of an epoch as the plan executes them (see
    step_facts)."""
    mini_batches = mini_batch_slices(num_sequences, cfg.actor.ppo_mini_batches)
    runs = _merged_runs(plan)
    if runs is None:
        return mini_batches
    return tuple(tuple(i for m in run for i in mini_batches[m]) for run in runs)


def _merged_runs(plan: StepPlan | None) -> tuple[tuple[int, ...], ...] | None:
    """The mini-batches each optimizer step of an epoch covers, if some step merged several and
    every epoch repeats the same runs (it does: kept tokens do not change between epochs)."""
    if plan is None:
        return None
    per_epoch: dict[int, list[tuple[int, ...]]] = {}
    for opt_step in plan.optimizer_steps:
        per_epoch.setdefault(opt_step.epoch, []).append(opt_step.source_mini_batches)
    runs = {tuple(r) for r in per_epoch.values()}
    if len(runs) != 1:
        return None  # epochs differ: judge on the unmerged (more conservative) slices
    [only] = runs
    return only if any(len(run) > 1 for run in only) else None


def planner_inputs(
    cfg: RunConfig,
    seq_tokens: Sequence[int],
    response_tokens: Sequence[int],
    advantages: Sequence[float],
    group_ids: Sequence[int],
) -> PlannerInputs:
    a = cfg.actor
    terms = loss_terms(cfg)
    return PlannerInputs(
        seq_tokens=tuple(seq_tokens),
        response_tokens=tuple(response_tokens),
        advantages=tuple(advantages),
        group_ids=tuple(group_ids),
        loss_agg=cfg.loss_agg,
        loss_scale_factor=cfg.loss_scale_factor,
        dp_size=cfg.dp,
        ppo_mini_batches=a.ppo_mini_batches,
        ppo_epochs=a.ppo_epochs,
        micro_batch_tokens=a.micro_batch_tokens,
        mode=resolve_prune_mode(cfg.planner.prune_zero_adv, terms)[0],
        allow_approx=cfg.planner.allow_approx,
        loss_terms=terms,
        micro_batch_multiple=a.micro_batch_multiple,
    )


class BatchFacts(TypedDict):
    """The per-sequence fields of :class:`PlannerInputs` (keywords to it)."""

    seq_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    advantages: tuple[float, ...]
    group_ids: tuple[int, ...]


def batch_facts(batch: RolloutBatch | RolloutShard) -> BatchFacts:
    """What the planner reads of ``batch`` (a shard's header will do): each sequence's length,
    trained response tokens, advantage and group."""
    return BatchFacts(
        seq_tokens=tuple(batch.seq_lens),
        response_tokens=tuple(batch.trained_lens),
        advantages=tuple(batch.advantages.tolist()),
        group_ids=tuple(batch.group_ids.tolist()),
    )


def every_sequence_inputs(cfg: RunConfig, header: RolloutShard) -> PlannerInputs:
    """Planner inputs that keep every sequence of ``header`` (a ``RolloutShard``): for passes
    that run before the advantages exist (KL in the reward, the critic's values), every
    advantage counts as non-zero, so nothing is pruned and the split balances all of them."""
    n = header.num_seqs
    return planner_inputs(
        cfg, header.seq_lens, header.trained_lens, [1.0] * n, header.group_ids.tolist()
    )


def critic_planner_inputs(cfg: RunConfig, actor_inputs: PlannerInputs) -> PlannerInputs:
    """The critic's plan of the batch the actor's ``actor_inputs`` (:func:`planner_inputs`)
    describe: its own mini-batches, epochs and aggregation, every sequence trained (a value loss
    does not vanish at advantage 0, see ``pruning_refusal``)."""
    return dataclasses.replace(
        actor_inputs,
        loss_agg=cfg.critic.loss_agg,
        # a value loss alone: no KL, entropy, router or observation term
        loss_terms=LossTerms(adv_estimator=actor_inputs.loss_terms.adv_estimator),
        ppo_mini_batches=cfg.critic_ppo_mini_batches,
        ppo_epochs=cfg.critic_ppo_epochs,
        mode="off",
    )

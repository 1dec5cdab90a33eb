"""Translate a :class:`RunConfig` (and a step's batch facts) into planner and gate inputs.

Pure: the CLI's start-up validation and every rank's step loop build their planner inputs and
gate facts here, so both agree on what the config means and no worker re-derives a rule inline.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.config.schema import RunConfig
from megarl.planner.batch_planner import (
    PlannerInputs,
    StepPlan,
    mini_batch_slices,
    resolve_prune_mode,
)
from megarl.planner.gates import GateConfig, RunFacts, Schedule, StepFacts


def schedule(cfg: RunConfig) -> Schedule:
    return Schedule.from_ppo(cfg.actor.ppo_mini_batches, cfg.actor.ppo_epochs)


def prune_mode(cfg: RunConfig) -> tuple[str, str]:
    """The planner mode ``planner.prune_zero_adv`` resolves to, and why (``auto``: see
    :func:`~megarl.planner.batch_planner.resolve_prune_mode`)."""
    return resolve_prune_mode(cfg.planner.prune_zero_adv, cfg.actor.kl_coef, cfg.actor.entropy_coef)


def gate_config(cfg: RunConfig) -> GateConfig:
    return GateConfig(old_log_prob=cfg.planner.old_log_prob, ref_log_prob=cfg.planner.ref_log_prob)


def run_facts(cfg: RunConfig) -> RunFacts:
    """What is known at start-up: validates forced gate choices, decides the reference model."""
    return RunFacts(
        modes=gate_config(cfg),
        schedule=schedule(cfg),
        num_steps=cfg.trainer.total_steps,
        kl_coef=cfg.actor.kl_coef,
        lora_enabled=cfg.actor.lora.enabled,
    )


def step_facts(
    cfg: RunConfig,
    step: int,
    num_sequences: int,
    engine_base_weights_resident: bool | None = None,
    plan: StepPlan | None = None,
) -> StepFacts:
    """The gates' view of one step: the slices are what each optimizer step consumes.

    Those are the baseline mini-batches, unless ``plan`` (this step's :class:`StepPlan`) merged
    them (``planner.prune_zero_adv=fast``): then the merged runs are the slices, so a sequence
    trained before the rollout's first optimizer step is not recomputed just because the
    unmerged schedule would have trained it later.
    """
    consumption, slices = executed_schedule(cfg, num_sequences, plan)
    return StepFacts(
        step=step,
        schedule=consumption,
        slices=slices,
        modes=gate_config(cfg),
        kl_coef=cfg.actor.kl_coef,
        lora_enabled=cfg.actor.lora.enabled,
        engine_base_weights_resident=engine_base_weights_resident,
    )


def executed_schedule(
    cfg: RunConfig,
    num_sequences: int,
    plan: StepPlan | None = None,
) -> tuple[Schedule, tuple[tuple[int, ...], ...]]:
    """(schedule, slices) of the optimizer steps as the plan executes them (see step_facts)."""
    mini_batches = mini_batch_slices(num_sequences, cfg.actor.ppo_mini_batches)
    runs = _merged_runs(plan)
    if runs is None:
        return schedule(cfg), mini_batches
    merged = tuple(tuple(i for m in run for i in mini_batches[m]) for run in runs)
    return Schedule.from_ppo(len(runs), cfg.actor.ppo_epochs), merged


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
        return None  # epochs differ: judge on the unmerged (more conservative) schedule
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
    return PlannerInputs(
        seq_tokens=seq_tokens,
        response_tokens=response_tokens,
        advantages=advantages,
        group_ids=group_ids,
        loss_agg=a.loss_agg,
        kl_coef=a.kl_coef,
        entropy_coef=a.entropy_coef,
        dp_size=cfg.dp,
        ppo_mini_batches=a.ppo_mini_batches,
        ppo_epochs=a.ppo_epochs,
        micro_batch_tokens=a.micro_batch_tokens,
        mode=prune_mode(cfg)[0],
        allow_approx=cfg.planner.allow_approx,
    )

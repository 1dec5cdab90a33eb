"""Translate a :class:`RunConfig` (and a step's batch facts) into planner and gate inputs.

Pure: the CLI's start-up validation and every rank's step loop build their planner inputs and
gate facts here, so both agree on what the config means and no worker re-derives a rule inline.
"""

from __future__ import annotations

from collections.abc import Sequence

from megarl.config.schema import RunConfig
from megarl.planner.batch_planner import PlannerInputs, mini_batch_slices
from megarl.planner.gates import GateConfig, RunFacts, Schedule, StepFacts


def schedule(cfg: RunConfig) -> Schedule:
    return Schedule.from_ppo(cfg.actor.ppo_mini_batches, cfg.actor.ppo_epochs)


def gate_config(cfg: RunConfig) -> GateConfig:
    return GateConfig(old_log_prob=cfg.planner.old_log_prob, ref_log_prob=cfg.planner.ref_log_prob)


def run_facts(cfg: RunConfig) -> RunFacts:
    """What is known at start-up: validates forced gate choices, decides the reference model."""
    return RunFacts(modes=gate_config(cfg), schedule=schedule(cfg),
                    num_steps=cfg.trainer.total_steps, kl_coef=cfg.actor.kl_coef,
                    lora_enabled=cfg.actor.lora.enabled)


def step_facts(cfg: RunConfig, step: int, num_sequences: int,
               engine_base_weights_resident: bool | None = None) -> StepFacts:
    """The gates' view of one step; slices are the planner's baseline mini-batches."""
    return StepFacts(
        step=step, schedule=schedule(cfg),
        slices=mini_batch_slices(num_sequences, cfg.actor.ppo_mini_batches),
        modes=gate_config(cfg), kl_coef=cfg.actor.kl_coef, lora_enabled=cfg.actor.lora.enabled,
        engine_base_weights_resident=engine_base_weights_resident,
    )


def planner_inputs(cfg: RunConfig, seq_tokens: Sequence[int], response_tokens: Sequence[int],
                   advantages: Sequence[float], group_ids: Sequence[int]) -> PlannerInputs:
    a = cfg.actor
    return PlannerInputs(
        seq_tokens=seq_tokens, response_tokens=response_tokens, advantages=advantages,
        group_ids=group_ids, loss_agg=a.loss_agg, kl_coef=a.kl_coef,
        entropy_coef=a.entropy_coef, dp_size=cfg.dp, ppo_mini_batches=a.ppo_mini_batches,
        ppo_epochs=a.ppo_epochs, micro_batch_tokens=a.micro_batch_tokens,
        mode=cfg.planner.prune_zero_adv, allow_approx=cfg.planner.allow_approx,
    )

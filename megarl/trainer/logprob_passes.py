"""The step's forward-only passes: old (proximal) and reference logprobs, run where the gates say.

The gates (:mod:`megarl.planner.gates`) name the sequences each pass runs on and why; this
module only executes them over the sequences this DP rank trains, in micro-batches within
``actor.logprob_micro_batch_tokens``, or takes logprobs the KL in the reward already computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.algo.router_replay import replay_plan
from megarl.config import planning
from megarl.distributed import heartbeat
from megarl.planner.batch_planner import plan_step
from megarl.planner.gate_results import ReferenceSource, StepGates
from megarl.planner.gates import decide_gates
from megarl.planner.micro_batches import plan_forward_micro_batches
from megarl.planner.step_plan import StepPlan
from megarl.trainer import moe_routing
from megarl.trainer.progress import reported
from megarl.trainer.scatter import scatter_sequences

if TYPE_CHECKING:
    from megarl.batch import RolloutShard
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.rollout_source import StepRollout
    from megarl.trainer.runtime import Runtime


@dataclass(frozen=True)
class Precomputed:
    """Logprobs the KL in the reward computed before the plan, for the sequences this rank
    runs in it: the step's old-logprob and reference passes reuse them."""

    old: dict[int, torch.Tensor]
    """Recomputed old logprobs (empty when the engine's stand in, or off the last stage)."""
    ref: dict[int, torch.Tensor]
    """Reference logprobs, where the gates ran the reference pass (empty otherwise)."""


@dataclass(frozen=True)
class StepLogprobs:
    """What the passes produced for this rank's trained sequences."""

    old: dict[int, torch.Tensor]
    """Old logprobs where they do not come from the training forward (recomputed, or the
    engine's under ``planner.old_log_prob=rollout``)."""
    recomputed: dict[int, torch.Tensor]
    """The recomputed ones alone: the trainer's own logprobs under the weights the step starts
    from, what the engine check compares."""
    ref: dict[int, torch.Tensor] | None
    routing: dict[int, torch.Tensor]
    """The actor's experts of every input position of the recomputed sequences (recorded for
    router replay R2 and the routing check), empty otherwise."""


@dataclass(frozen=True)
class EverySequence:
    """A step's passes on every sequence, run before its plan (the KL in the reward and
    distillation rewrite the advantages the plan is made from): the unpruned plan and its
    gates, this rank's scattered sequences, their old and reference logprobs."""

    plan: StepPlan
    gates: StepGates
    batch: RolloutShard
    logprobs: StepLogprobs


def passes_on_every_sequence(
    rt: Runtime, step: int, rollout: StepRollout, timer: PhaseTimer
) -> EverySequence:
    """Collective: plan every sequence (nothing pruned: the advantages are not final), gate,
    scatter, and run the old and reference passes the gates ask for."""
    cfg, header = rt.cfg, rollout.header
    unpruned = plan_step(planning.every_sequence_inputs(cfg, header))
    gates = decide_gates(
        planning.step_facts(
            cfg,
            step,
            header.num_seqs,
            engine_base_weights_resident=rollout.engine_state.base_weights_resident,
            behaviour_versions=header.oldest_versions,
        )
    )
    batch = scatter_sequences(rt, rollout.batch, header, unpruned)
    return EverySequence(unpruned, gates, batch, logprob_passes(rt, batch, unpruned, gates, timer))


def logprob_passes(
    rt: Runtime,
    batch: RolloutShard,
    plan: StepPlan,
    gates: StepGates,
    timer: PhaseTimer,
    precomputed: Precomputed | None = None,
    record_routing: bool = False,
) -> StepLogprobs:
    """Run the forwards the gates asked for, over the sequences this DP rank trains (or take
    them from ``precomputed``: the KL in the reward ran them on every sequence already).

    With ``record_routing`` the old-logprob pass records the actor's routing where the engine
    reported routing (the pass runs on the generating weights), and under router replay R2
    always (the training forwards replay it); under R3 it replays the engine's routing.
    """
    mine = plan.trained_sequences(rt.dp_rank)
    if precomputed is not None:
        return _reuse_logprobs(rt, batch, mine, gates, precomputed)
    temperature = rt.cfg.rollout.temperature
    budget = rt.cfg.actor.logprob_micro_batch_tokens
    multiple = rt.cfg.actor.micro_batch_multiple
    recomputed: dict[int, torch.Tensor] = {}
    routing: dict[int, torch.Tensor] = {}
    replay = replay_plan(rt.cfg.actor.router_replay.mode)
    if gates.old_log_prob.source == "rollout":
        old = {i: batch.engine_logprobs[i] for i in mine}
    else:
        if gates.old_log_prob.run:
            wanted = set(gates.old_log_prob.seq_indices)
            groups = plan_forward_micro_batches(
                [i for i in mine if i in wanted], batch.seq_lens, budget, multiple
            )
            heartbeat.mark("old_log_prob")
            num_seqs = sum(len(group) for group in groups)
            with (
                timer.phase("old_log_prob"),
                reported(rt.progress, "old_log_prob", num_seqs, "sequences"),
                moe_routing.recording(
                    rt.actor, batch, record_routing, replay.old_log_prob_records_for_training
                ) as routing,
                moe_routing.replaying(
                    rt.actor,
                    moe_routing.engine_replay(
                        rt.actor, batch, replay, [i for g in groups for i in g]
                    ),
                ),
            ):
                recomputed = rt.actor.compute_logprobs(batch, groups, temperature)
        old = recomputed
    ref = None
    if gates.ref_log_prob.run:
        groups = plan_forward_micro_batches(list(mine), batch.seq_lens, budget, multiple)
        heartbeat.mark("ref")
        with timer.phase("ref"), reported(rt.progress, "ref", len(mine), "sequences"):
            ref = reference_logprobs(rt, batch, groups, temperature)
    return StepLogprobs(old, recomputed, ref, routing)


def _reuse_logprobs(
    rt: Runtime,
    batch: RolloutShard,
    mine: tuple[int, ...],
    gates: StepGates,
    pre: Precomputed,
) -> StepLogprobs:
    """The step's logprob passes when the KL in the reward or distillation already ran them on
    every sequence (the gates then name every sequence; a mismatch would mean the two
    disagree)."""
    if gates.old_log_prob.source == "rollout":
        old = {i: batch.engine_logprobs[i] for i in mine}
        recomputed: dict[int, torch.Tensor] = {}
    else:
        recomputed = {i: pre.old[i] for i in mine if i in pre.old}
        old = recomputed
    ref = {i: pre.ref[i] for i in mine if i in pre.ref} if gates.ref_log_prob.run else None
    complete = len(old) == len(mine) and (ref is None or len(ref) == len(mine))
    unused = ref is None and bool(pre.ref)
    if rt.actor.is_last_stage and (unused or not complete):
        raise RuntimeError(
            f"precomputed logprobs of {len(old)}/{len(mine)} sequences, "
            f"or ones the gates do not use ({gates.summary()})"
        )
    return StepLogprobs(old, recomputed, ref, {})


def reference_logprobs(rt: Runtime, batch: RolloutShard, groups, temperature: float):
    """Run the reference forward from the source decided at start-up (see decide_reference)."""
    if rt.reference_source is ReferenceSource.ACTOR_WITHOUT_ADAPTERS:
        return rt.actor.compute_logprobs(batch, groups, temperature, without_adapters=True)
    if rt.reference is None:
        raise RuntimeError(
            "the gates run the reference pass, but start-up decided no step "
            "needs one (decide_reference and decide_ref_log_prob disagree)"
        )
    return rt.reference.compute_logprobs(batch, groups, temperature)

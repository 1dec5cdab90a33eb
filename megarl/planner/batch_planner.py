"""Batch planner: the exact work of every data-parallel rank for one GRPO rollout batch.

:func:`plan_step` is pure (stdlib + numpy): it turns per-sequence lengths, advantages and the
actor's batching config (:class:`~megarl.planner.inputs.PlannerInputs`) into a frozen
:class:`~megarl.planner.step_plan.StepPlan` -- for each optimizer step, which sequences each DP
rank runs, grouped into micro-batches, with which loss weight, and the normaliser every
micro-batch divides its loss sum by. Workers only execute it.

It composes four decisions, each in its own module, in this order:

1. :mod:`megarl.planner.pruning` -- whether pruning zero-advantage sequences is exact for this
   configuration (refused, approximate or exact), hence which sequences are trained;
2. :mod:`megarl.planner.optimizer_steps` -- which baseline mini-batches each optimizer step of
   an epoch covers (``off``, ``match_loss_curve``, ``fast``) and the normaliser of each;
3. :mod:`megarl.planner.micro_batches` -- per non-ghost step, which trained sequences each DP
   rank runs, packed into micro-batches, with fillers so every rank runs equally many
   (on :mod:`megarl.planner.partition`'s cost model and algorithms);
4. here: the steps of the first epoch, repeated for every epoch, and the reasons gathered on
   the way, into a :class:`~megarl.planner.step_plan.StepPlan`.

Invariants of every plan (``tests/unit/test_batch_planner.py::assert_invariants``):

1. Every kept sequence (every sequence in ``off``; advantage != 0 otherwise) is trained -- appears
   with loss weight 1 -- exactly once per epoch; nothing else ever has weight 1.
2. In ``off`` every sequence is trained exactly once per epoch; ``off`` never has a ghost step.
3. Within a step all ranks have the same number of micro-batches: zero for a ghost step, at
   least one otherwise.
4. Every micro-batch holds at most ``micro_batch_tokens`` tokens unless it is a single sequence
   longer than the budget; ``num_tokens`` is the sum of its sequences' ``seq_tokens``.
5. The normaliser of a step is :func:`~megarl.planner.optimizer_steps.normaliser_of` the
   unpruned baseline mini-batch(es) it covers (response tokens, sequences, or sequences x
   ``loss_scale_factor``); fillers and pruning never change it.
6. A step is a ghost step iff the mini-batch(es) it covers contain no kept sequence.
7. ``off`` and ``match_loss_curve`` have exactly ``ppo_epochs * ppo_mini_batches`` steps in
   (epoch, mini-batch) order; ``fast`` has between ``ppo_epochs`` and that many.
8. Deterministic: equal inputs give equal plans (all ties go to the lower index).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from megarl.planner.inputs import BatchArrays, PlannerInputs
from megarl.planner.micro_batches import padding_reasons, plan_ranks
from megarl.planner.optimizer_steps import normaliser_of, optimizer_runs, step_label
from megarl.planner.pruning import check_pruning_config, pruning_reasons, pruning_refusal
from megarl.planner.step_plan import OptimizerStepPlan, RankPlan, StepPlan


def plan_step(inputs: PlannerInputs) -> StepPlan:
    """Decide every optimizer step of one rollout batch (see the module docstring)."""
    approx_reason = check_pruning_config(inputs.mode, inputs.loss_terms, inputs.allow_approx)
    batch = BatchArrays.of(inputs)
    runs = optimizer_runs(inputs, batch)
    reasons = pruning_reasons(inputs, batch, approx_reason, len(runs))
    first_epoch: list[OptimizerStepPlan] = []
    for run_index, run in enumerate(runs):
        step, step_reasons = _plan_run(run_index, run, inputs, batch)
        first_epoch.append(step)
        reasons.extend(step_reasons)
    kept_tokens = int(batch.seq_tokens[batch.kept].sum())
    return StepPlan(
        optimizer_steps=_repeat_for_epochs(first_epoch, inputs.ppo_epochs),
        approximate=approx_reason is not None,
        reasons=tuple(reasons),
        num_sequences=inputs.num_sequences,
        num_kept_sequences=int(batch.kept.sum()),
        num_tokens=int(batch.seq_tokens.sum()),
        num_kept_tokens=kept_tokens,
        pruning_refused=pruning_refusal(inputs.loss_terms),
    )


def _repeat_for_epochs(
    first_epoch: list[OptimizerStepPlan], num_epochs: int
) -> tuple[OptimizerStepPlan, ...]:
    """Every epoch runs the same steps; only the epoch number differs (rank plans are shared)."""
    return tuple(
        step if epoch == 0 else replace(step, epoch=epoch)
        for epoch in range(num_epochs)
        for step in first_epoch
    )


def _plan_run(
    run_index: int, run: tuple[int, ...], inputs: PlannerInputs, batch: BatchArrays
) -> tuple[OptimizerStepPlan, list[str]]:
    """The epoch-0 plan of one optimizer step covering the baseline mini-batches ``run``."""
    members = np.arange(run[0] * batch.mini_batch_size, (run[-1] + 1) * batch.mini_batch_size)
    trained = members[batch.kept[members]]
    label = step_label(inputs.mode, run_index, run)
    normaliser = normaliser_of(
        batch.response_tokens[members].tolist(), inputs.loss_agg, inputs.loss_scale_factor
    )
    if len(trained) == 0:
        ghost = OptimizerStepPlan(
            epoch=0,
            mini_batch=run_index,
            source_mini_batches=run,
            ranks=(RankPlan(micro_batches=()),) * inputs.dp_size,
            normaliser=normaliser,
            is_ghost=True,
        )
        return ghost, [f"{label} has no kept sequence: ghost step"]
    ranks, rank_costs, fillers_per_rank = plan_ranks(members, trained, inputs, batch)
    step = OptimizerStepPlan(
        epoch=0,
        mini_batch=run_index,
        source_mini_batches=run,
        ranks=ranks,
        normaliser=normaliser,
        is_ghost=False,
        rank_costs=rank_costs,
        trained_cost=float(batch.costs[trained].sum()),
    )
    return step, padding_reasons(label, fillers_per_rank)

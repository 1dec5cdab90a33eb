"""On-policy distillation in the rank loop: the teacher scores every sampled token before the plan.

With ``algo.distill.teacher_path`` the advantages are per token and need two forwards of every
sequence first: the student's old (proximal) logprobs and the teacher's. The plan prunes by
advantage, so, as for the KL in the reward, both run on an unpruned split before it; rank 0
then makes each token's advantage (:func:`megarl.algo.distill.distill_token_advantages`, pure)
and broadcasts a per-sequence summary the planner reads (0 only when every token's advantage
is 0, so pruning stays exact). The token advantages reach the actor as a critic's GAE does
(``token_advantages``), and the old (and reference) logprobs follow each sequence to the rank
the plan gives it (:func:`megarl.trainer.kl_in_reward.scatter_logprobs`): no pass runs twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from megarl.algo.distill import distill_token_advantages, reverse_kl_mean, sequence_summaries
from megarl.batch import RolloutBatch, RolloutShard
from megarl.config.schema import RunConfig
from megarl.distributed import heartbeat
from megarl.planner.gate_results import StepGates
from megarl.planner.micro_batches import plan_forward_micro_batches
from megarl.planner.step_plan import StepPlan
from megarl.trainer.logprob_passes import StepLogprobs, passes_on_every_sequence
from megarl.trainer.progress import reported
from megarl.trainer.rollout import advantage_metrics
from megarl.trainer.scatter import scatter_by_dp_rank

if TYPE_CHECKING:
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.rollout_source import StepRollout
    from megarl.trainer.runtime import Runtime

REVERSE_KL_METRIC = "distill/reverse_kl/mean"


@dataclass(frozen=True)
class Distillation:
    """What distillation leaves for the rest of the step (rank 0; None elsewhere)."""

    logprobs: dict[int, tuple[Tensor, Tensor | None]] | None
    """``{seq: (old, ref or None)}`` of every sequence, for ``scatter_logprobs``."""
    token_advantages: dict[int, Tensor] | None
    """Each sequence's per-response-token advantages."""


def distill_advantages(
    rt: Runtime, step: int, rollout: StepRollout, timer: PhaseTimer
) -> tuple[StepRollout, Distillation]:
    """Old, reference (where gated) and teacher logprobs of every sequence; then (rank 0) the
    distillation advantages, on every rank their per-sequence summary."""
    cfg = rt.cfg
    every = passes_on_every_sequence(rt, step, rollout, timer)
    teacher = teacher_logprobs(rt, every.batch, every.plan, every.gates, timer)
    gathered: list | None = [None] * dist.get_world_size() if rt.host is not None else None
    dist.gather_object(_local_triples(rt, every.logprobs, teacher), gathered, dst=0)
    payload: list = [None]
    merged, token_advantages, metrics = None, None, {}
    if rollout.batch is not None and gathered is not None:
        merged = {i: triple for part in gathered for i, triple in part.items()}
        token_advantages, summary_B, metrics = distill_targets(cfg, rollout.batch, merged)
        payload = [summary_B]
    dist.broadcast_object_list(payload, src=0)
    pairs = None if merged is None else {i: (o, r) for i, (o, r, _) in merged.items()}
    return rollout.with_advantages(payload[0], metrics), Distillation(pairs, token_advantages)


def teacher_logprobs(
    rt: Runtime, batch: RolloutShard, plan: StepPlan, gates: StepGates, timer: PhaseTimer
) -> dict[int, Tensor]:
    """The teacher's logprobs of the sequences this DP rank runs in ``plan`` (empty off the
    last stage), in the micro-batches the old-logprob pass used: a teacher equal to the
    student then gives bit-identical logprobs."""
    if rt.teacher is None or not gates.teacher_log_prob.run:
        raise RuntimeError(f"distillation without a teacher pass ({gates.summary()})")
    wanted = set(gates.teacher_log_prob.seq_indices)
    mine = [i for i in plan.trained_sequences(rt.dp_rank) if i in wanted]
    groups = plan_forward_micro_batches(
        mine,
        batch.seq_lens,
        rt.cfg.actor.logprob_micro_batch_tokens,
        rt.cfg.actor.micro_batch_multiple,
    )
    heartbeat.mark("teacher")
    with timer.phase("teacher"), reported(rt.progress, "teacher", len(mine), "sequences"):
        return rt.teacher.compute_logprobs(batch, groups, rt.cfg.rollout.temperature)


def _local_triples(rt: Runtime, passes: StepLogprobs, teacher: Mapping[int, Tensor]) -> dict:
    """``{seq: (old, ref or None, teacher)}`` of this rank's sequences (last stage only)."""
    if not rt.actor.is_last_stage:
        return {}
    ref = passes.ref
    return {
        i: (passes.old[i].float(), None if ref is None else ref[i].float(), logp.float())
        for i, logp in teacher.items()
    }


def distill_targets(
    cfg: RunConfig, rollout: RolloutBatch, merged: Mapping[int, tuple]
) -> tuple[dict[int, Tensor], Tensor, dict[str, float]]:
    """Rank 0: every sequence's token advantages, their per-sequence summary (what the planner
    and ``RolloutBatch.advantages`` carry) and the metrics: ``distill/reverse_kl/mean`` and the
    ``critic/advantages/*`` of the trained tokens."""
    n = rollout.num_seqs
    if sorted(merged) != list(range(n)):
        raise RuntimeError(f"distillation got logprobs of {len(merged)}/{n} sequences")
    lengths = [len(merged[i][0]) for i in range(n)]
    student_BT = pad_sequence([merged[i][0] for i in range(n)], batch_first=True)
    teacher_BT = pad_sequence([merged[i][2] for i in range(n)], batch_first=True)
    masks = rollout.response_masks  # agent loops: observation tokens are off the mask
    mask_BT = pad_sequence(
        [torch.ones(lengths[i]) if masks is None else masks[i].float() for i in range(n)],
        batch_first=True,
    )
    advantages_BT = distill_token_advantages(
        student_BT, teacher_BT, rollout.advantages, mask_BT, cfg.algo.distill.reward_coef
    )
    token_advantages = {i: advantages_BT[i, : lengths[i]].float() for i in range(n)}
    trained = advantages_BT[mask_BT != 0]
    metrics = {REVERSE_KL_METRIC: reverse_kl_mean(student_BT, teacher_BT, mask_BT)}
    if trained.numel():
        metrics.update(advantage_metrics(trained))
    summary_B = sequence_summaries(advantages_BT, mask_BT, rollout.advantages.dtype)
    return token_advantages, summary_B, metrics


def scatter_token_advantages(
    rt: Runtime, token_advantages: Mapping[int, Tensor] | None, plan: StepPlan
) -> dict[int, Tensor]:
    """Rank 0 sends every rank the token advantages of the sequences it runs in ``plan``."""
    if token_advantages is None:
        return scatter_by_dp_rank(rt, None, plan)
    advantages = token_advantages
    return scatter_by_dp_rank(rt, lambda seqs: {i: advantages[i] for i in seqs}, plan)

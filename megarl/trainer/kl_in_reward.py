"""``algo.use_kl_in_reward``: penalise the rewards with KL(old || ref) before the advantages.

The reward needs the KL of *every* sequence before the advantages exist, and the plan (which
prunes by advantage) comes after them. So the old and reference logprobs of every sequence are
computed first, on an unpruned split; rank 0 subtracts ``beta * KL`` per token
(:func:`megarl.algo.kl_reward.apply_kl_penalty`, which also updates the controller), recomputes
the advantages and broadcasts them; the logprobs then follow each sequence to the rank the
step's plan gives it (:func:`scatter_logprobs`), so the step's own passes do not run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.algo.advantages import get_advantage_estimator
from megarl.algo.kl_reward import KLController, apply_kl_penalty
from megarl.batch import RolloutBatch
from megarl.config import planning
from megarl.config.schema import RunConfig
from megarl.planner.step_plan import StepPlan
from megarl.trainer.logprob_passes import Precomputed, passes_on_every_sequence

if TYPE_CHECKING:
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.rollout_source import StepRollout
    from megarl.trainer.runtime import Runtime


@dataclass(frozen=True)
class RewardKL:
    """What the KL in the reward leaves for the rest of the step (rank 0; None elsewhere)."""

    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    """``{seq: (old, ref)}`` of every sequence, for :func:`scatter_logprobs`."""
    token_rewards: dict[int, torch.Tensor] | None
    """Each sequence's penalised token rewards: what GAE reads with a critic."""


def kl_in_reward(
    rt: Runtime, step: int, rollout: StepRollout, timer: PhaseTimer
) -> tuple[StepRollout, RewardKL]:
    """Old and reference logprobs of every sequence, then (rank 0) the rewards penalised with
    their KL and the advantages recomputed from the penalised scores, on every rank; the
    ``critic/kl*`` metrics join the rollout's (rank 0)."""
    cfg = rt.cfg
    passes = passes_on_every_sequence(rt, step, rollout, timer).logprobs
    local = {}
    if rt.actor.is_last_stage and passes.ref is not None:
        local = {i: (passes.old[i].float(), passes.ref[i].float()) for i in passes.ref}
    gathered: list | None = [None] * dist.get_world_size() if rt.host is not None else None
    dist.gather_object(local, gathered, dst=0)
    payload: list = [None]
    merged, token_rewards = None, None
    metrics: dict[str, float] = {}
    if rollout.batch is not None and gathered is not None and rt.kl_ctrl is not None:
        merged = {i: pair for part in gathered for i, pair in part.items()}
        advantages, metrics, token_rewards = penalise_rewards(
            cfg, rollout.batch, merged, rt.kl_ctrl
        )
        payload = [advantages]
    dist.broadcast_object_list(payload, src=0)
    return rollout.with_advantages(payload[0], metrics), RewardKL(merged, token_rewards)


def penalise_rewards(
    cfg: RunConfig, rollout: RolloutBatch, merged: dict, kl_ctrl: KLController
) -> tuple[torch.Tensor, dict[str, float], dict[int, torch.Tensor]]:
    """Rank 0: rewards minus ``beta * KL`` (:func:`apply_kl_penalty`, which also updates the
    controller), the estimator on the penalised scores, the new advantage metrics, and each
    sequence's penalised token rewards (what GAE reads; a critic's advantages come later, in
    :func:`megarl.trainer.critic_step.values_and_gae`, so they are left as they are here)."""
    from torch.nn.utils.rnn import pad_sequence

    from megarl.trainer.rollout import advantage_metrics

    if sorted(merged) != list(range(rollout.num_seqs)):
        raise RuntimeError(f"KL in the reward got logprobs of {len(merged)}/{rollout.num_seqs}")
    order = range(rollout.num_seqs)
    old_BT = pad_sequence([merged[i][0] for i in order], batch_first=True)
    ref_BT = pad_sequence([merged[i][1] for i in order], batch_first=True)
    masks = rollout.response_masks
    mask_BT = pad_sequence(
        [torch.ones(len(merged[i][0])) if masks is None else masks[i].float() for i in order],
        batch_first=True,
    )
    result = apply_kl_penalty(
        rollout.rewards, old_BT, ref_BT, mask_BT, cfg.algo.kl_penalty, kl_ctrl
    )
    token_rewards = {i: result.token_rewards_BT[i, : len(merged[i][0])].float() for i in order}
    kl_metrics = {
        "critic/kl": result.current_kl,
        "critic/kl_coef": result.beta,
        # recent verl's names for the same two numbers, for dashboards moved over from it
        "actor/reward_kl_penalty": result.current_kl,
        "actor/reward_kl_penalty_coeff": result.beta,
    }
    if cfg.algo.uses_critic:
        return rollout.advantages, kl_metrics, token_rewards
    advantages = get_advantage_estimator(cfg.algo.estimator)(result.scores_B, rollout.group_ids)
    return advantages, {**advantage_metrics(advantages), **kl_metrics}, token_rewards


def scatter_logprobs(rt: Runtime, merged: dict | None, plan: StepPlan) -> Precomputed:
    """Rank 0 sends every rank the precomputed ``(old, ref)`` logprobs (the KL in the reward's,
    or distillation's, whose ``ref`` is None where the reference pass did not run) of the
    sequences it runs in ``plan`` (which may put a sequence on another DP rank than the
    unpruned split did)."""
    parts = None
    if merged is not None:
        by_dp = {
            dp: {i: merged[i] for i in plan.sequences_on_rank(dp)} for dp in set(rt.rank_to_dp)
        }
        parts = [by_dp[dp] for dp in rt.rank_to_dp]
    received: list = [None]
    dist.scatter_object_list(received, parts, src=0)
    mine = received[0]
    recompute = planning.old_log_prob_mode(rt.cfg).value != "rollout"
    return Precomputed(
        old={i: old for i, (old, _) in mine.items()} if recompute else {},
        ref={i: ref for i, (_, ref) in mine.items() if ref is not None},
    )

"""PPO's critic in the rank loop: the rollout's values, GAE on rank 0, the critic's update.

With ``algo.adv_estimator=gae`` every step runs, as verl's PPO does: the critic's values of
every response token (on an unpruned split, like the KL in the reward, since the advantages
are what this computes), then on rank 0 the token rewards (the outcome reward on the last
token, KL-penalised when the KL is in the reward) and GAE (:mod:`megarl.algo.gae`) give each
token an advantage and a return; the critic is then trained on the returns, the actor on the
advantages. The math is pure and lives in :mod:`megarl.algo.gae`; this module moves tensors
between ranks and runs the critic's passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from megarl.actor.megatron_actor import reduce_sums_to_all
from megarl.algo.gae import critic_data_metrics, gae_advantage_return, outcome_token_rewards
from megarl.batch import RolloutBatch, RolloutShard
from megarl.config import planning
from megarl.config.actor import ActorConfig, LoraConfig
from megarl.config.schema import RunConfig
from megarl.critic.megatron_critic import MegatronCritic, ValueLossSettings
from megarl.critic.value_stats import CriticStepStats, summarise_critic_update
from megarl.distributed import heartbeat
from megarl.planner.batch_planner import plan_step
from megarl.planner.micro_batches import plan_forward_micro_batches
from megarl.planner.step_plan import StepPlan
from megarl.trainer.progress import PhaseHook, no_progress, reported
from megarl.trainer.rollout import advantage_metrics
from megarl.trainer.scatter import scatter_by_dp_rank, scatter_sequences

if TYPE_CHECKING:
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.rollout_source import StepRollout
    from megarl.trainer.runtime import Runtime


@dataclass(frozen=True)
class CriticTargets:
    """What the two updates read, per response token of each sequence a rank runs."""

    values: dict[int, Tensor]
    """The rollout's values: the critic's clipping centre."""
    returns: dict[int, Tensor]
    """GAE's returns: the critic's regression targets."""
    advantages: dict[int, Tensor]
    """GAE's whitened advantages: the actor's."""

    def subset(self, seq_indices: Sequence[int]) -> CriticTargets:
        return CriticTargets(
            values={i: self.values[i] for i in seq_indices},
            returns={i: self.returns[i] for i in seq_indices},
            advantages={i: self.advantages[i] for i in seq_indices},
        )


def values_and_gae(
    rt: Runtime,
    rollout: StepRollout,
    token_rewards: Mapping[int, Tensor] | None,
    timer: PhaseTimer,
) -> tuple[StepRollout, CriticTargets | None]:
    """The critic's values of every sequence (an unpruned split), then on rank 0 GAE's
    targets of every sequence and the ``critic/*`` data metrics; every rank gets the
    per-sequence advantage summary the planner reads."""
    assert rt.critic is not None
    cfg = rt.cfg
    unpruned = plan_step(planning.every_sequence_inputs(cfg, rollout.header))
    batch = scatter_sequences(rt, rollout.batch, rollout.header, unpruned)
    heartbeat.mark("values")
    mine = unpruned.trained_sequences(rt.dp_rank)
    with timer.phase("values"), reported(rt.progress, "values", len(mine), "sequences"):
        values = gather_values(rt.critic, batch, mine, cfg.actor.logprob_micro_batch_tokens)
    payload: list = [None]
    targets, metrics = None, {}
    if rollout.batch is not None and values is not None:
        with timer.phase("adv"):
            targets, summary_B, metrics = gae_targets(cfg, rollout.batch, values, token_rewards)
        payload = [summary_B]
    dist.broadcast_object_list(payload, src=0)
    return rollout.with_advantages(payload[0], metrics), targets


def scatter_targets(
    rt: Runtime, targets: CriticTargets | None, plan: StepPlan, critic_plan: StepPlan
) -> CriticTargets:
    """Rank 0 sends every rank the GAE targets of the sequences it runs in either plan."""
    source = None if targets is None else targets.subset
    return scatter_by_dp_rank(rt, source, plan, critic_plan)


def critic_update(
    rt: Runtime, batch: RolloutShard, plan: StepPlan, targets: CriticTargets, timer: PhaseTimer
) -> dict[str, float]:
    """Every optimizer step of the critic's plan; its ``critic/*`` update metrics."""
    assert rt.critic is not None
    heartbeat.mark("update_critic")
    with timer.phase("update_critic"):
        return update_critic(rt.critic, rt.cfg, batch, plan, rt.dp_rank, targets, rt.progress)


def critic_model_config(cfg: RunConfig) -> ActorConfig:
    """The critic's model settings: the actor's layout and batching, the critic's optimizer,
    all weights trained (no LoRA)."""
    return dataclasses.replace(
        cfg.actor, lr=cfg.critic.lr, optim=cfg.critic.optim, lora=LoraConfig()
    )


def gather_values(
    critic: MegatronCritic, batch: RolloutShard, seq_indices: Sequence[int], budget: int
) -> dict[int, Tensor] | None:
    """Values of ``seq_indices`` (this rank's share of an unpruned split), gathered on global
    rank 0 (None elsewhere). Collective."""
    groups = plan_forward_micro_batches(list(seq_indices), batch.seq_lens, budget)
    local = critic.compute_values(batch, groups)  # empty off the last stage
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if gathered is None:
        return None
    return {i: values for part in gathered for i, values in part.items()}


def gae_targets(
    cfg: RunConfig,
    rollout: RolloutBatch,
    values: Mapping[int, Tensor],
    token_rewards: Mapping[int, Tensor] | None,
) -> tuple[CriticTargets, Tensor, dict[str, float]]:
    """Rank 0: GAE over the whole batch (the whitening needs every token).

    Returns the targets of every sequence, a per-sequence summary of the advantages (their
    token mean: what the planner and ``RolloutBatch.advantages`` carry; the planner never
    prunes on it, see ``pruning_refusal``) and the ``critic/*`` data metrics.
    """
    n = rollout.num_seqs
    if sorted(values) != list(range(n)):
        raise RuntimeError(f"the critic's values pass covered {len(values)}/{n} sequences")
    values_BT = pad_sequence([values[i].double() for i in range(n)], batch_first=True)
    lengths = [len(values[i]) for i in range(n)]
    # multi-turn: observation tokens are off the mask, so GAE's recursion passes over them
    # (neither a TD error nor a break between the turns around them) and they get no target
    masks = rollout.response_masks
    mask_BT = pad_sequence(
        [torch.ones(lengths[i]) if masks is None else masks[i].float() for i in range(n)],
        batch_first=True,
    )
    if token_rewards is None:
        rewards_BT = outcome_token_rewards(rollout.rewards, mask_BT)
    else:
        rewards_BT = pad_sequence([token_rewards[i].double() for i in range(n)], batch_first=True)
    result = gae_advantage_return(rewards_BT, values_BT, mask_BT, cfg.algo.gamma, cfg.algo.lam)
    targets = CriticTargets(
        values={i: values[i].float() for i in range(n)},
        returns={i: result.returns_BT[i, : lengths[i]].float() for i in range(n)},
        advantages={i: result.advantages_BT[i, : lengths[i]].float() for i in range(n)},
    )
    summary_B = torch.stack(
        [_masked_mean(targets.advantages[i], mask_BT[i, : lengths[i]]) for i in range(n)]
    )
    metrics = {
        **advantage_metrics(result.advantages_BT[mask_BT != 0]),
        **critic_data_metrics(values_BT, result.returns_BT, mask_BT),
    }
    return targets, summary_B, metrics


def _masked_mean(x_T: Tensor, mask_T: Tensor) -> Tensor:
    """The mean of ``x_T`` over its tokens on the mask (0 for none)."""
    on = mask_T != 0
    return x_T[on].mean() if bool(on.any()) else x_T.new_zeros(())


def update_critic(
    critic: MegatronCritic,
    cfg: RunConfig,
    batch: RolloutShard,
    plan: StepPlan,
    dp_rank: int,
    targets: CriticTargets,
    progress: PhaseHook = no_progress,
) -> dict[str, float]:
    """Every optimizer step of the critic's plan; verl's ``critic/*`` update metrics, each the
    mean over optimizer steps of the step's global value. ``progress`` is told each step."""
    settings = ValueLossSettings(
        cliprange_value=cfg.critic.cliprange_value,
        agg=cfg.critic.loss_agg,
        loss_scale_factor=cfg.loss_scale_factor,
    )
    rows: list[list[float]] = []
    grad_norms: list[float] = []
    num_steps = len(plan.optimizer_steps)
    for index, opt_step in enumerate(plan.optimizer_steps):
        progress("update_critic", index, num_steps, "optimizer steps")
        result = critic.train_values(
            batch, opt_step, dp_rank, targets.values, targets.returns, settings
        )
        stats = result.stats if critic.is_last_stage else CriticStepStats()
        rows.append(stats.to_row())
        grad_norms.append(result.grad_norm)
    progress("update_critic", num_steps, num_steps, "optimizer steps")
    summed = [CriticStepStats.from_row(row) for row in reduce_sums_to_all(rows, cfg.actor.tp)]
    return {**summarise_critic_update(summed, grad_norms), "critic/lr": cfg.critic.lr}

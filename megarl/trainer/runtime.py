"""What a rank holds for the whole run: its models, its place in the layout, its rollout source.

Built once by :func:`megarl.trainer.rank_loop` 's set-up; every stage of a step
(:mod:`megarl.trainer.rank_loop` lists them) reads it and none replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megarl.planner.gate_results import ReferenceSource
from megarl.trainer.metrics import StartupClock
from megarl.trainer.progress import PhaseHook, no_progress

if TYPE_CHECKING:
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.actor.router_stats import RouterMonitor
    from megarl.algo.kl_reward import KLController
    from megarl.config.schema import RunConfig
    from megarl.critic.megatron_critic import MegatronCritic
    from megarl.models.spec import TransformerSpec
    from megarl.sft.conversations import SFTExample
    from megarl.trainer.engine_guard import EngineGuard
    from megarl.trainer.rollout_host import RolloutHost
    from megarl.trainer.rollout_source import RolloutSource


@dataclass
class Runtime:
    cfg: RunConfig
    dp_rank: int
    actor: MegatronActor
    reference: MegatronActor | None  # built only for ReferenceSource.MODEL
    reference_source: ReferenceSource
    teacher: MegatronActor | None = field(default=None, kw_only=True)
    """``algo.distill.teacher_path``: the frozen teacher whose logprobs make the advantages."""
    rank_to_dp: tuple[int, ...]
    """The data-parallel rank of every global rank (what the rollout scatter sends where)."""
    host: RolloutHost | None
    """Rank 0 only: the rollout host, or in split placement its proxy (same methods)."""
    spec: TransformerSpec
    source: RolloutSource
    """Where each step's batch comes from (:mod:`megarl.trainer.rollout_source`)."""
    model_dir: str = ""
    resume_from: str | None = None
    kl_ctrl: KLController | None = None
    """``algo.use_kl_in_reward``: the reward KL's coefficient; rank 0's is the one used and
    checkpointed."""
    critic: MegatronCritic | None = None
    """``algo.adv_estimator=gae``: PPO's value model, on the actor's ranks and layout."""
    routers: RouterMonitor | None = None
    """Mixture-of-experts models: counts the actor's routing during the update."""
    progress: PhaseHook = no_progress
    """Rank 0 with ``trainer.progress`` on: the console's phase display (the work done in each
    phase); a no-op everywhere else."""
    startup: StartupClock = field(default_factory=StartupClock)
    sft_validation: list[SFTExample] | None = None
    """``algo.objective=sft`` with ``data.val_files``: the validation conversations (every
    rank holds them; each scores its data-parallel share)."""
    """Rank 0 reports from it where the start-up went (``timing_s/startup/*``)."""
    guard: EngineGuard | None = None
    """The logprob guard (``rollout.max_logprob_diff``); None when off or without an engine."""


def pipeline_group(pp: int):
    """This rank's pipeline-parallel group (the stages of its model replica); None at PP = 1."""
    if pp == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()

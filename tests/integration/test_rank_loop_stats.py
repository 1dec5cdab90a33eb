"""The rank loop's actor (and critic) update reports each metric as the mean over optimizer steps.

A one-process gloo world and a scripted actor stand in for Megatron, so the wiring from the
planner's optimizer steps through the all-reduce to the reported numbers runs in a second.
"""

from __future__ import annotations

import math
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megarl.actor.megatron_actor import TrainStepResult
from megarl.actor.train_stats import OptimizerStepStats
from megarl.batch import RolloutBatch
from megarl.config.planning import batch_facts
from megarl.config.schema import RunConfig
from megarl.critic.megatron_critic import CriticStepResult
from megarl.critic.value_stats import CriticStepStats
from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import PlannerInputs
from megarl.trainer.actor_update import update_actor
from megarl.trainer.critic_step import CriticTargets, update_critic
from megarl.trainer.logprob_passes import StepLogprobs
from megarl.trainer.metrics import PhaseTimer
from megarl.trainer.progress import no_progress


@pytest.fixture
def one_rank_world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _ScriptedActor:
    """Returns the given statistics for its optimizer steps, in order."""

    is_last_stage = True

    def __init__(self, script: list[tuple[float, float, float]]) -> None:
        self.script = list(script)
        self.calls: list[tuple[int, int]] = []

    def train_step(
        self, batch, step, dp_rank, old, ref, loss, capture_logprobs=False, token_advantages=None
    ):
        assert token_advantages is None  # no critic in these runs
        self.calls.append((step.epoch, step.mini_batch))
        pg_loss, entropy, grad_norm = self.script.pop(0)
        stats = OptimizerStepStats(
            pg_loss=pg_loss, entropy_sum=10 * entropy, response_tokens=10, num_tokens=10
        )
        return TrainStepResult(stats=stats, grad_norm=grad_norm, train_logprobs={})


def _batch_and_plan(n: int = 8, ppo_epochs: int = 1):
    """Two groups of four 6-token sequences (4 response tokens, engine logprobs all 0), planned
    into two mini-batches."""
    batch = RolloutBatch(
        tokens=tuple(torch.arange(6) for _ in range(n)),
        prompt_lens=(2,) * n,
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        rewards=torch.zeros(n),
        advantages=torch.tensor([1.0, -1.0] * 4),
        engine_logprobs=tuple(torch.zeros(4) for _ in range(n)),
    )
    plan = plan_step(
        PlannerInputs(
            **batch_facts(batch),
            ppo_mini_batches=2,
            ppo_epochs=ppo_epochs,
        )
    )
    return batch, plan


def test_two_mini_batches_two_epochs_report_means_not_sums(one_rank_world) -> None:
    batch, plan = _batch_and_plan(ppo_epochs=2)
    actor = _ScriptedActor([(0.4, 1.0, 1.0), (-0.2, 2.0, 2.0), (0.1, 3.0, 3.0), (0.5, 2.0, 6.0)])
    rt = _runtime(actor)
    stats = update_actor(rt, batch, plan, StepLogprobs({}, {}, None, {}), PhaseTimer())
    assert actor.calls == [(0, 0), (0, 1), (1, 0), (1, 1)]
    metrics = stats.metrics()
    assert metrics["actor/num_optimizer_steps"] == 4
    assert metrics["actor/pg_loss"] == pytest.approx(0.2)  # the sum would be 0.8
    assert metrics["actor/entropy"] == pytest.approx(2.0)
    assert metrics["actor/grad_norm"] == pytest.approx(3.0)


def _runtime(actor) -> SimpleNamespace:
    """What ``update_actor`` reads of the rank's runtime: rank 0 without the live display or
    the logprob guard."""
    return SimpleNamespace(
        cfg=RunConfig(), actor=actor, dp_rank=0, progress=no_progress, guard=None
    )


class _LogprobActor(_ScriptedActor):
    """Also hands back training-forward logprobs of the first optimizer step's sequences."""

    def __init__(self, script, train_logprobs: dict[int, torch.Tensor]) -> None:
        super().__init__(script)
        self.train_logprobs = train_logprobs

    def train_step(
        self, batch, step, dp_rank, old, ref, loss, capture_logprobs=False, token_advantages=None
    ):
        result = super().train_step(
            batch, step, dp_rank, old, ref, loss, capture_logprobs, token_advantages
        )
        captured = self.train_logprobs if capture_logprobs else {}
        return TrainStepResult(
            stats=result.stats, grad_norm=result.grad_norm, train_logprobs=captured
        )


def test_rollout_corr_metrics_cover_train_forward_and_recomputed_sequences(one_rank_world) -> None:
    """The first step's training-forward logprobs and the recomputed ones, against the engine's
    (all 0): sequence i's tokens have log-ratio (i - 3.5) / 10, so the extremes are seqs 0, 7."""
    n = 8
    batch, plan = _batch_and_plan(n)
    trainer = {i: torch.full((4,), (i - 3.5) / 10) for i in range(n)}
    actor = _LogprobActor([(0.1, 1.0, 1.0)] * 2, {i: trainer[i] for i in range(4)})
    rt = _runtime(actor)
    recomputed = {i: trainer[i] for i in range(4, n)}
    passes = StepLogprobs(recomputed, recomputed, None, {})
    metrics = update_actor(rt, batch, plan, passes, PhaseTimer()).metrics()
    assert metrics["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.35), rel=1e-6)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(math.exp(-0.35), rel=1e-6)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0


class _ScriptedCritic:
    """Returns the given statistics and gradient norms for its optimizer steps, in order."""

    is_last_stage = True

    def __init__(self, script: list[tuple[CriticStepStats, float]]) -> None:
        self.script = list(script)

    def train_values(self, batch, step, dp_rank, values, returns, settings) -> CriticStepResult:
        stats, grad_norm = self.script.pop(0)
        return CriticStepResult(stats=stats, grad_norm=grad_norm)


def test_critic_update_reports_means_over_steps_of_each_steps_ratios(one_rank_world) -> None:
    """Four optimizer steps, one a ghost (no tokens): the losses and gradient norms average over
    all four, the per-token ratios over the three steps with tokens, each formed within its
    step after the all-reduce."""
    batch, plan = _batch_and_plan(ppo_epochs=2)
    critic = _ScriptedCritic(
        [
            (
                CriticStepStats(vf_loss=0.4, vf_clipfrac_sum=2.0, vpred_sum=5.0, num_tokens=10.0),
                1.0,
            ),
            (
                CriticStepStats(vf_loss=0.2, vf_clipfrac_sum=1.0, vpred_sum=-5.0, num_tokens=20.0),
                3.0,
            ),
            (CriticStepStats(), 2.0),
            (CriticStepStats(vf_loss=0.6, vf_clipfrac_sum=0.0, vpred_sum=3.0, num_tokens=4.0), 6.0),
        ]
    )
    cfg = RunConfig()
    metrics = update_critic(critic, cfg, batch, plan, 0, CriticTargets({}, {}, {}))  # type: ignore[arg-type]
    assert not critic.script
    assert metrics == pytest.approx(
        {
            "critic/vf_loss": (0.4 + 0.2 + 0.0 + 0.6) / 4,
            "critic/vf_clipfrac": (0.2 + 0.05 + 0.0) / 3,
            "critic/vpred_mean": (0.5 - 0.25 + 0.75) / 3,
            "critic/grad_norm": 3.0,
            "critic/lr": cfg.critic.lr,
        }
    )

"""Multi-turn trajectories in the training batch: observation tokens (mask 0) are read by the
model but never trained, counted, compared or corrected; on plain tensors, in milliseconds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.agent.loop import AgentSettings
from megarl.agent.trajectory import GenerateOutput, Trajectory
from megarl.algo.losses import aggregate, policy_loss
from megarl.algo.rollout_correction import CorrectionSettings, mismatch_stats_of_sequences
from megarl.batch import RolloutBatch, build_micro_batch, response_mask
from megarl.config import planning
from megarl.config.schema import ConfigError, build_run_config
from megarl.data.problems import Problem
from megarl.planner.batch_planner import plan_step
from megarl.planner.optimizer_steps import normaliser_of
from megarl.trainer.actor_update import logprob_diff
from megarl.trainer.agent_rollout import (
    join_agent_metrics,
    needs_agent_loops,
    problem_row,
    trajectory_generation,
)
from megarl.trainer.critic_step import gae_targets
from megarl.trainer.generations import rollout_records
from megarl.trainer.rollout import mask_runs, rollout_metrics

# sequence 0: prompt 2, response [g g o o o g] (3 generated, 3 observation)
# sequence 1: prompt 3, response [g g] (single turn, every token generated)
MASKS = (torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0]))


def _batch(masks=MASKS) -> RolloutBatch:
    tokens = (torch.arange(10, 18), torch.arange(20, 25))
    prompts = (2, 3)
    logprobs = (
        torch.tensor([-1.0, -2.0, 0.0, 0.0, 0.0, -0.5]),  # 0.0: an observation has no logprob
        torch.tensor([-0.25, -0.75]),
    )
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=prompts,
        group_ids=torch.tensor([0, 0]),
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        engine_logprobs=logprobs,
        response_masks=masks,
    )


def test_the_batch_counts_only_generated_tokens_as_trained():
    batch = _batch()
    assert batch.response_lens == [6, 2]
    assert batch.trained_lens == [3, 2]
    assert _batch(masks=None).trained_lens == [6, 2]
    shard = batch.shard([0])
    assert shard.trained_lens == [3, 2]  # every sequence's count: what the planner reads
    assert set(shard.response_masks) == {0}
    assert response_mask(shard, 0) is not None and response_mask(shard, 1) is None
    assert batch.shard([]).trained_lens == [3, 2]
    assert _batch(masks=None).shard([0]).trained_lens == [6, 2]


def test_a_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="response masks of"):
        _batch(masks=(torch.ones(5), torch.ones(2)))


@pytest.mark.parametrize("packed", [False, True])
def test_observation_labels_have_mask_zero_in_both_layouts(packed):
    mb = build_micro_batch(_batch(), [0, 1], pad_id=0, loss_weights=[1.0, 2.0], packed=packed)
    # sequence 0: response labels at positions 1..6 (prompt 2): g g o o o g
    assert mb.response_mask_BL[0].tolist() == [0, 1, 1, 0, 0, 0, 1, 0]
    assert mb.loss_mask_BL[1].tolist() == [0, 0, 2, 2, 0, 0, 0, 0]
    plain = build_micro_batch(_batch(masks=None), [0], pad_id=0, packed=packed)
    assert plain.response_mask_BL[0].tolist() == [0, 1, 1, 1, 1, 1, 1, 0]


def test_the_token_mean_loss_is_the_mean_over_generated_tokens_only():
    """The loss of the masked batch, normalised by the planner's count, equals the formula
    applied to the generated tokens alone (the observation tokens' values are garbage on
    purpose: they must not matter)."""
    batch = _batch()
    mb = build_micro_batch(batch, [0, 1], pad_id=0)
    torch.manual_seed(0)
    logp = torch.randn(mb.loss_mask_BL.shape)
    old = logp + 0.1 * torch.randn(mb.loss_mask_BL.shape)
    observation = (mb.loss_mask_BL == 0) & (torch.arange(8) > 0)
    logp_garbage = torch.where(observation, torch.full_like(logp, 1e6), logp)
    denom = normaliser_of(batch.trained_lens, "token-mean")
    assert denom == 5.0
    got = policy_loss(
        logp_garbage, old, mb.advantages_B, mb.loss_mask_BL, 0.2, 0.2, "token-mean", denom=denom
    ).loss
    ratio = (logp - old).exp()
    adv = mb.advantages_B.unsqueeze(1).expand_as(ratio)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    generated = mb.loss_mask_BL > 0
    assert generated.sum() == 5
    assert got.item() == pytest.approx(per_token[generated].mean().item(), rel=1e-6)
    entropy = aggregate(logp_garbage, mb.loss_mask_BL, "token-mean", denom=denom)
    assert entropy.item() == pytest.approx(logp[generated].mean().item(), rel=1e-6)


def test_the_planner_normalises_by_generated_tokens():
    cfg = build_run_config({"rollout": {"n": 2}, "data": {"prompts_per_step": 1}})
    batch = _batch()
    plan = plan_step(planning.planner_inputs(cfg, **planning.batch_facts(batch)))
    assert plan.optimizer_steps[0].normaliser == 5.0  # of 8 response tokens


def test_logprob_diff_and_mismatch_compare_generated_tokens_only():
    batch = _batch()
    trainer = {
        0: torch.tensor([-1.0, -2.5, -7.0, -7.0, -7.0, -0.5]),
        1: torch.tensor([-0.25, -1.0]),
    }
    total, count = logprob_diff(batch.shard([0, 1]), trainer)
    assert count == 5 and total == pytest.approx(0.5 + 0.25)
    settings = CorrectionSettings()
    masked = mismatch_stats_of_sequences(
        trainer, dict(enumerate(batch.engine_logprobs)), settings, masks=dict(enumerate(MASKS))
    )
    keep = [torch.tensor([0, 1, 5]), torch.tensor([0, 1])]
    alone = mismatch_stats_of_sequences(
        {i: trainer[i][k] for i, k in enumerate(keep)},
        {i: batch.engine_logprobs[i][k] for i, k in enumerate(keep)},
        settings,
    )
    assert masked.metrics() == pytest.approx(alone.metrics())


def test_gae_over_a_trajectory_skips_its_observations():
    """A critic over multi-turn trajectories: GAE's targets of a trajectory with observation
    tokens are those of the same trajectory with the observations cut out (the recursion
    passes over them), they get advantage and return 0, the reward sits on the last generated
    token, and the per-sequence summary averages generated tokens only."""
    cfg = build_run_config({"algo": {"adv_estimator": "gae", "lam": 0.9, "gamma": 0.99}})
    values = {0: torch.tensor([0.2, -0.1, 5.0, 5.0, 5.0, 0.4]), 1: torch.tensor([0.3, 0.6])}
    targets, summary_B, _ = gae_targets(cfg, _batch(), values, None)

    cut = {0: torch.tensor([0.2, -0.1, 0.4]), 1: values[1]}
    cut_batch = _batch(masks=None)
    cut_batch = dataclasses.replace(
        cut_batch,
        tokens=(torch.arange(10, 15), cut_batch.tokens[1]),
        engine_logprobs=(torch.tensor([-1.0, -2.0, -0.5]), cut_batch.engine_logprobs[1]),
    )
    expected, expected_summary_B, _ = gae_targets(cfg, cut_batch, cut, None)
    on = MASKS[0] != 0
    for name in ("returns", "advantages"):
        got, want = getattr(targets, name), getattr(expected, name)
        torch.testing.assert_close(got[0][on], want[0])
        assert torch.equal(got[0][~on], torch.zeros(3))
        torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(summary_B, expected_summary_B)


def test_response_length_metrics_count_generated_tokens():
    metrics = rollout_metrics(_batch(), [True, True], max_new_tokens=8)
    assert metrics["response_length/mean"] == 2.5 and metrics["response_length/max"] == 3.0


def test_a_trajectory_becomes_a_generation_with_its_mask():
    traj = Trajectory([1, 2, 3], max_response_tokens=16)
    traj.add_generated(GenerateOutput((7, 8), (-0.5, -0.25), "stop"))
    traj.add_observation([40, 41, 42])
    traj.add_generated(GenerateOutput((9,), (-1.0,), "stop"))
    gen = trajectory_generation(traj)
    assert gen.prompt_ids == (1, 2, 3) and gen.response_ids == (7, 8, 40, 41, 42, 9)
    assert gen.response_mask == (1, 1, 0, 0, 0, 1)
    assert gen.response_logprobs == (-0.5, -0.25, 0.0, 0.0, 0.0, -1.0)
    assert gen.finished
    assert mask_runs(gen.response_ids, gen.response_mask) == [
        ([7, 8], True),
        ([40, 41, 42], False),
        ([9], True),
    ]
    assert mask_runs([5, 6], None) == [([5, 6], True)]
    cut = trajectory_generation(traj, limit=4)  # a loop that overran the response budget
    assert cut.response_ids == (7, 8, 40, 41) and cut.response_mask == (1, 1, 0, 0)
    assert cut.response_logprobs == (-0.5, -0.25, 0.0, 0.0) and not cut.finished


def test_the_generations_dump_shows_the_turns_and_what_trained():
    records = rollout_records(
        1,
        [("q", "a obs b", "1")],
        [1.0],
        [0.5],
        [0],
        [0],
        turns=[[("a", True), ("obs", False), ("b", True)]],
    )
    assert records[0]["turns"] == [
        {"text": "a", "trained": True},
        {"text": "obs", "trained": False},
        {"text": "b", "trained": True},
    ]
    assert "turns" not in rollout_records(1, [("q", "a", "1")], [1.0], [0.5], [0], [0])[0]


def test_which_problems_run_under_agent_loops():
    plain = Problem("p", "1", "f:1")
    named = Problem("p", "1", "f:2", agent_name="tool_agent")
    single = Problem("p", "1", "f:3", agent_name="single_turn_agent")
    assert not needs_agent_loops("single_turn", [plain, single])
    assert needs_agent_loops("single_turn", [plain, named])
    assert needs_agent_loops("tool", [plain])
    row = problem_row(
        Problem(
            "p",
            "42",
            "f:1",
            data_source="openai/gsm8k",
            agent_name="tool_agent",
            tools_kwargs={"calculator": {"create_kwargs": {"x": 1}}},
        ),
        [{"role": "user", "content": "p"}],
    )
    assert row["agent_name"] == "tool_agent"
    assert row["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {"x": 1}}}
    assert row["reward_model"]["ground_truth"] == "42" and row["data_source"] == "openai/gsm8k"


def test_agent_metrics_of_several_generation_batches_join():
    joined = join_agent_metrics(
        [
            {"agent/num_turns/mean": 2.0, "agent/num_turns/max": 3.0, "agent/tool_errors": 1.0},
            {"agent/num_turns/mean": 1.0, "agent/num_turns/max": 2.0, "agent/tool_errors": 2.0},
        ]
    )
    assert joined == {
        "agent/num_turns/mean": 1.5,
        "agent/num_turns/max": 3.0,
        "agent/tool_errors": 3.0,
    }


def test_what_multi_turn_does_not_combine_with_yet_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        build_run_config(
            {"actor": {"router_replay": {"mode": "R3"}}, "rollout": {"agent": {"loop": "tool"}}}
        )
    message = str(refused.value)
    assert "rollout.agent.loop=tool with actor.router_replay.mode=R3" in message
    assert "\n" not in message


def test_partial_rollouts_combine_with_agent_loops():
    cfg = build_run_config(
        {
            "rollout": {"n_gpus": 1, "agent": {"loop": "tool"}},
            "trainer": {"launcher": "ray"},
            "async_training": {"mode": "fully_async", "partial_rollout": True},
        }
    )
    assert cfg.async_training.partial_rollout and cfg.rollout.multi_turn


def test_the_agent_keys_build_and_single_turn_is_the_default():
    ppo = build_run_config(
        {"algo": {"adv_estimator": "gae"}, "rollout": {"agent": {"loop": "tool"}}}
    )
    assert ppo.algo.uses_critic and ppo.rollout.multi_turn
    cfg = build_run_config({"rollout": {"agent": {"loop": "tool", "max_turns": 3}}})
    assert cfg.rollout.multi_turn and cfg.rollout.agent == AgentSettings(loop="tool", max_turns=3)
    assert not build_run_config({}).rollout.multi_turn

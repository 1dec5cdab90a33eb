"""DAPO's dynamic sampling and overlong shaping: the pure rules by hand, then the rollout
producer with a scripted engine (which groups it keeps, how many batches it generates, where it
stops), all on plain data."""

from __future__ import annotations

import pytest
import torch
from helpers.char_text import CharTokenizer

from megarl.algo.dapo import FilterDecision, groups_with_signal, overlong_penalty
from megarl.data.loader import PromptStream
from megarl.data.problems import Problem
from megarl.data.rewards import Reward, RewardChoice
from megarl.engines.base import Generation
from megarl.trainer.rollout import FilterGroupsExhausted, RolloutProducer, RolloutSettings


def test_overlong_penalty_is_zero_then_linear_to_minus_the_factor():
    # max 20, buffer 5: free up to 15 tokens, then -0.5 per token (factor 2.5 / buffer 5)
    got = overlong_penalty([3, 15, 16, 18, 20], max_new_tokens=20, buffer_len=5, penalty_factor=2.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.5, -2.5])


def test_overlong_penalty_refuses_a_buffer_longer_than_the_limit():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty([1], max_new_tokens=4, buffer_len=5, penalty_factor=1.0)


def test_groups_with_signal_are_those_whose_scores_differ():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1e-9])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert groups_with_signal(scores, group_ids).tolist() == [False, True, False, True]


def test_filter_decision_stops_at_enough_or_at_the_limit():
    assert FilterDecision(4, 4, 1, 10).enough
    assert not FilterDecision(3, 4, 9, 10).give_up
    gave_up = FilterDecision(3, 4, 10, 10)
    assert gave_up.give_up and not gave_up.enough
    assert "max_num_gen_batches=10" in gave_up.message(7) and "step 7" in gave_up.message(7)
    assert not FilterDecision(0, 4, 1000, 0).give_up  # 0 = no limit


class _ScriptedEngine:
    """Answers prompt ``p<k>`` with the k-th scripted group of responses, in call order."""

    def __init__(self, groups: list[list[str]]):
        self.groups, self.calls, self.seeds = groups, 0, []

    def generate_requests(self, requests, params, interrupt=None):
        self.seeds.append(requests[0].seed)  # one batch, one sampling stream of seeds
        out = []
        for ids in (request.prompt_ids for request in requests):
            k = int("".join(chr(i) for i in ids)[1:])
            text = self.groups[k][len([o for o in out if o.prompt_ids == tuple(ids)])]
            response = tuple(ord(c) for c in text)
            out.append(Generation(tuple(ids), response, (0.0,) * len(response), finished=True))
        self.calls += 1
        return out


def _producer(groups, prompts_per_step=2, **settings) -> tuple[RolloutProducer, _ScriptedEngine]:
    problems = [Problem(prompt=f"p{k}", answer="yes", source=f"p{k}") for k in range(len(groups))]
    engine = _ScriptedEngine(groups)
    stream = PromptStream(problems, prompts_per_step, seed=0, shuffle=False)
    base = {"group_size": 2, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
    producer = RolloutProducer(
        engine,  # type: ignore[arg-type]  (only generate_requests() is used)
        CharTokenizer(),
        stream,
        RewardChoice(
            "m:f", Reward("m:f", lambda response, answer: float(response.startswith(answer)))
        ),
        RolloutSettings(adv_estimator="grpo", **{**base, **settings}),
        run_seed=1,
    )
    return producer, engine


GROUPS = [
    ["yes", "yes"],  # all right: no signal
    ["yes", "no"],
    ["no", "no"],  # all wrong: no signal
    ["no", "yes!"],
    ["yes", "nope"],
    ["no", "no"],
]


def test_without_the_filter_one_batch_is_generated_as_before():
    producer, engine = _producer(GROUPS)
    batch, metrics, _ = producer.produce(step=1)
    assert engine.calls == 1 and batch.num_seqs == 4
    assert batch.rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert "train/num_gen_batches" not in metrics


def test_the_filter_keeps_groups_with_signal_and_generates_until_full():
    producer, engine = _producer(GROUPS, filter_groups=True)
    batch, metrics, _ = producer.produce(step=1)
    # batch 1 = p0 (dropped), p1 (kept); batch 2 = p2 (dropped), p3 (kept): full after 2
    assert engine.calls == 2
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert (batch.advantages != 0).all()
    assert metrics["train/num_gen_batches"] == 2.0
    assert metrics["train/filtered_groups"] == 2.0
    assert len(set(engine.seeds)) == 2, "every generation batch samples with its own seed"
    unfiltered, plain_engine = _producer(GROUPS)
    unfiltered.produce(step=1)
    assert plain_engine.seeds[0] == engine.seeds[0], "the first batch is the unfiltered one"


def test_extra_groups_beyond_the_step_are_not_trained():
    groups = GROUPS[1:2] + GROUPS[3:5] + GROUPS[:1]
    producer, _ = _producer(groups, prompts_per_step=3, filter_groups=True)
    batch, _, _ = producer.produce(step=1)
    assert batch.num_seqs == 6  # three kept groups from the first batch, nothing more


def test_the_filter_stops_with_one_line_at_its_limit():
    producer, _ = _producer([["no", "no"]] * 6, filter_groups=True, max_num_gen_batches=2)
    with pytest.raises(FilterGroupsExhausted, match="found 0 of 2 groups") as stopped:
        producer.produce(step=3)
    assert "\n" not in str(stopped.value)


def test_overlong_shaping_lowers_the_reward_of_long_responses():
    groups = [["yes", "yes and more"], ["no", "no"]]
    producer, _ = _producer(
        groups, max_new_tokens=12, overlong_buffer_len=4, overlong_penalty_factor=1.0
    )
    batch, metrics, _ = producer.produce(step=1)
    # "yes and more" is 12 tokens: at the limit, -1.0; "yes" is free
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert metrics["critic/rewards/overlong_penalty"] == pytest.approx(-0.25)
    assert metrics["critic/rewards/overlong_frac"] == pytest.approx(0.25)


def test_a_group_scored_alone_numbers_its_samples_as_its_step_does():
    """The asynchronous rollout scores each group as it finishes: a failing reward on group
    2's second sample is sample 5 of the step, as the synchronous step names it."""
    from megarl.data.rewards import RewardFunctionError

    def fails_on_no(response: str, answer: str) -> float:
        if response == "no":
            raise KeyError("no")
        return 1.0

    producer, _ = _producer(GROUPS)
    producer.reward = RewardChoice("m:f", Reward("m:f", fails_on_no))
    gen = [Generation((1,), tuple(ord(c) for c in t), (0.0,) * len(t), True) for t in ("y", "no")]
    problem = Problem(prompt="p2", answer="yes", source="p2")
    with pytest.raises(RewardFunctionError, match=r"sample 5 \(step 3\) raised KeyError"):
        producer.score_groups([problem], gen, [[0], [0, 0]], 3, first_group=2)

"""Reward shaping before the advantages: prime-rl's linear length penalty against a direct
transcription of its formula, then through the rollout producer (rewards and metrics)."""

from __future__ import annotations

import pytest
import torch
from helpers.char_text import CharTokenizer, TextQueueEngine

from megarl.algo.length_penalty import LengthWeights, count_turns, linear_length_penalty
from megarl.data.loader import PromptStream
from megarl.data.problems import Problem
from megarl.data.rewards import Reward, RewardChoice
from megarl.trainer.rollout import RolloutProducer, RolloutSettings

WEIGHTS = LengthWeights(
    num_output_tokens_weight=0.25, num_input_tokens_weight=0.1, num_turns_weight=0.1
)


def _transcribed(rewards, groups, output, inputs, turns, w: LengthWeights) -> list[float]:
    """prime-rl's per-group rule, loop by loop: pass rate times the weighted fractions of each
    quantity's group maximum (at least 1)."""
    penalties = [0.0] * len(rewards)
    for group in set(groups):
        members = [i for i, g in enumerate(groups) if g == group]
        pass_rate = sum(rewards[i] for i in members) / len(members)
        max_out = max(1, *(output[i] for i in members))
        max_in = max(1, *(inputs[i] for i in members))
        max_turns = max(1, *(turns[i] for i in members))
        for i in members:
            penalties[i] = pass_rate * (
                w.num_output_tokens_weight * output[i] / max_out
                + w.num_input_tokens_weight * inputs[i] / max_in
                + w.num_turns_weight * turns[i] / max_turns
            )
    return penalties


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_length_penalty_matches_prime_rl_formula_on_random_groups(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num = 24
    groups = (torch.arange(num) // 4)[torch.randperm(num, generator=gen)] * 7 - 3
    rewards = torch.rand(num, generator=gen)
    output = torch.randint(0, 200, (num,), generator=gen)
    inputs = torch.randint(0, 500, (num,), generator=gen)
    turns = torch.randint(1, 5, (num,), generator=gen)
    weights = LengthWeights(0.3, 0.05, 0.7)
    penalty = linear_length_penalty(rewards, groups, output, inputs, turns, weights)
    expected = _transcribed(
        rewards.tolist(), groups.tolist(), output.tolist(), inputs.tolist(), turns.tolist(), weights
    )
    torch.testing.assert_close(penalty, torch.tensor(expected, dtype=torch.float64))


def test_a_group_without_success_gets_no_penalty_and_keeps_exact_zero_advantages() -> None:
    """Pass rate 0: no penalty, so the constant group stays constant and is pruned."""
    from megarl.algo.advantages import get_advantage_estimator

    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    penalty = linear_length_penalty(
        rewards,
        groups,
        torch.tensor([5, 50, 9, 10, 40, 20]),
        torch.zeros(6),
        torch.ones(6),
        WEIGHTS,
    )
    assert penalty[:3].tolist() == [0.0, 0.0, 0.0]
    adv = get_advantage_estimator("grpo")((rewards - penalty).float(), groups)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # all correct: the shortest answer is now the best one, the longest the worst
    assert adv[3] > adv[5] > adv[4]


def test_count_turns_counts_runs_of_generated_tokens() -> None:
    assert count_turns(None) == 1
    assert count_turns((1, 1, 0, 0, 1, 0, 1, 1)) == 3
    assert count_turns((0, 1)) == 1
    assert count_turns(()) == 0


def _produce(texts: list[str], **settings) -> tuple[torch.Tensor, dict[str, float]]:
    problems = [Problem(prompt=f"p{k}", answer="yes", source=f"p{k}") for k in range(2)]
    base = {"group_size": 2, "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}
    producer = RolloutProducer(
        TextQueueEngine(texts),  # type: ignore[arg-type]  (only generate_requests() is used)
        CharTokenizer(),
        PromptStream(problems, 2, seed=0, shuffle=False),
        RewardChoice(
            "m:f", Reward("m:f", lambda response, answer: float(response.startswith(answer)))
        ),
        RolloutSettings(adv_estimator="grpo", **{**base, **settings}),
        run_seed=1,
    )
    batch, metrics, _ = producer.produce(step=1)
    return batch.rewards, metrics


def test_the_producer_subtracts_the_length_penalty_and_reports_it() -> None:
    texts = ["yes", "yes, sure!!", "no", "no, sorry"]
    plain, plain_metrics = _produce(texts)
    shaped, metrics = _produce(texts, length_penalty=WEIGHTS)
    assert plain.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert "critic/rewards/length_penalty" not in plain_metrics
    # group 0: pass rate 1; outputs 3 and 11 of max 11; prompts "p0" 2 of 2; one turn each
    expected_0 = [1 - (0.25 * 3 / 11 + 0.1 + 0.1), 1 - (0.25 + 0.1 + 0.1)]
    assert shaped.tolist() == pytest.approx([*expected_0, 0.0, 0.0])
    penalty = (plain - shaped).tolist()
    assert metrics["critic/rewards/length_penalty"] == pytest.approx(-sum(penalty) / 4)
    assert metrics["critic/rewards/length_penalty_frac"] == 0.5

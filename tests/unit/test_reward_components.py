"""Several reward functions per row (``data.reward`` as a list): the config form and its one-line
errors, the weighted sum every estimator reads, each function's metric, and GDPO reading each
function's scores apart through the rollout producer."""

from __future__ import annotations

import pytest
import torch
from helpers.char_text import CharTokenizer, TextQueueEngine

from megarl.algo.advantages import gdpo_advantages, get_advantage_estimator
from megarl.config.schema import ConfigError, build_run_config
from megarl.data.loader import PromptStream
from megarl.data.problems import Problem
from megarl.data.rewards import Reward, RewardChoice, WeightedReward
from megarl.engines.base import Generation
from megarl.trainer.rollout import RewardMixError, RolloutProducer, RolloutSettings


def test_the_single_reward_form_is_unchanged() -> None:
    cfg = build_run_config({"data": {"reward": "gsm8k"}})
    assert cfg.data.reward == "gsm8k" and cfg.data.reward_components is None
    assert cfg.data.weighted_rewards is None and cfg.data.reward_choice.configured == "gsm8k"


def test_the_list_form_names_weights_and_a_primary_function() -> None:
    cfg = build_run_config(
        {
            "data": {
                "reward": [
                    {"name": "correct", "fn": "gsm8k"},
                    {"fn": "exact_last_number", "weight": 0.5},
                ]
            }
        }
    )
    weighted = cfg.data.weighted_rewards
    assert weighted is not None
    assert [(w.name, w.choice.configured, w.weight) for w in weighted] == [
        ("correct", "gsm8k", 1.0),
        ("exact_last_number", "exact_last_number", 0.5),
    ]
    assert cfg.data.reward_choice.configured == "gsm8k"  # the first one: validation's


@pytest.mark.parametrize(
    ("reward", "needle"),
    [
        ([], "data.reward=[]: expected a name, package.module:function, or a non-empty list"),
        (7, "data.reward=7: expected a name"),
        ([{"fn": "nope"}], "data.reward[0].fn='nope': unknown reward function"),
        ([{"name": "a"}], "data.reward[0].fn=None: a reward function is required"),
        ([{"fn": "gsm8k", "wieght": 2}], "data.reward[0]: unknown key 'wieght'"),
        ([{"fn": "gsm8k"}, {"fn": "gsm8k"}], "data.reward[1].name='gsm8k': two reward"),
        ([{"fn": "gsm8k", "weight": "high"}], "data.reward[0].weight='high': expected a number"),
        ([{"fn": "gsm8k", "weight": float("inf")}], "data.reward[0].weight=inf: must be a finite"),
        ([{"fn": "gsm8k", "name": "a/b"}], "data.reward[0].name='a/b': a non-empty name"),
        (["gsm8k"], "data.reward[0]='gsm8k': expected a mapping"),
    ],
)
def test_a_bad_reward_list_is_one_line_naming_the_entry(reward: object, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_run_config({"data": {"reward": reward}})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_reward_function_that_cannot_be_imported_stops_the_start_in_one_line() -> None:
    from megarl.data.rewards import choose_rewards, parse_reward_components

    components = parse_reward_components([{"fn": "gsm8k"}, {"fn": "no_such_module:f"}])
    with pytest.raises(ValueError, match=r"data.reward\[1\].fn='no_such_module:f': cannot import"):
        choose_rewards(components, "files")


def _fn_reward(name: str, fn) -> RewardChoice:
    return RewardChoice(name, Reward(name, fn))


CORRECT = WeightedReward(
    "correct", _fn_reward("m:correct", lambda r, a: float(r.startswith(a))), 1.0
)
SHORT = WeightedReward("short", _fn_reward("m:short", lambda r, a: float(len(r) <= 4)), 0.5)

TEXTS = ["yes", "yes, sure", "no", "nope, yes", "yes!", "no"]
"""Three prompts, two samples each: (correct, short) = (1,1) (1,0) | (0,1) (0,0) | (1,1) (0,1)."""


def _produce(
    estimator: str,
    components=(CORRECT, SHORT),
    texts=TEXTS,
    num_prompts: int = 3,
    prompts_per_step: int | None = None,
    **settings,
):
    """One step of the real producer over prompts ``p0``, ``p1``... (answer "yes"), groups of
    2, answered with ``texts`` in order; ``prompts_per_step`` (default: all) per generation
    batch."""
    problems = [Problem(prompt=f"p{k}", answer="yes", source=f"p{k}") for k in range(num_prompts)]
    base = {"group_size": 2, "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0}
    per_step = num_prompts if prompts_per_step is None else prompts_per_step
    producer = RolloutProducer(
        TextQueueEngine(texts),  # type: ignore[arg-type]  (only generate_requests() is used)
        CharTokenizer(),
        PromptStream(problems, per_step, seed=0, shuffle=False),
        components[0].choice,
        RolloutSettings(adv_estimator=estimator, **{**base, **settings}),
        run_seed=1,
        components=components,
    )
    batch, metrics, _ = producer.produce(step=1)
    return batch, metrics


SCORES = torch.tensor([[1.0, 1], [1, 0], [0, 1], [0, 0], [1, 1], [0, 1]])
GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "maxrl"])
def test_other_estimators_read_the_weighted_sum(estimator: str) -> None:
    batch, metrics = _produce(estimator)
    summed = SCORES @ torch.tensor([1.0, 0.5])
    assert batch.rewards.tolist() == summed.tolist()
    expected = get_advantage_estimator(estimator)(summed, GROUPS)
    torch.testing.assert_close(batch.advantages, expected)
    assert metrics["reward/correct/mean"] == pytest.approx(0.5)
    assert metrics["reward/short/mean"] == pytest.approx(4 / 6)
    assert metrics["critic/rewards/mean"] == pytest.approx(float(summed.mean()))


def test_gdpo_reads_each_functions_scores_apart() -> None:
    batch, _ = _produce("gdpo")
    expected = gdpo_advantages(SCORES, GROUPS, torch.tensor([1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(batch.advantages, expected)
    on_sum = gdpo_advantages(SCORES @ torch.tensor([1.0, 0.5]), GROUPS)
    assert not torch.allclose(batch.advantages, on_sum), "per function, not on the sum"


def test_gdpo_takes_the_length_penalty_as_one_more_reward() -> None:
    from megarl.algo.length_penalty import LengthWeights

    weights = LengthWeights(0.25, 0.0, 0.0)
    batch, metrics = _produce("gdpo", length_penalty=weights)
    summed = SCORES @ torch.tensor([1.0, 0.5])
    shaping = batch.rewards - summed  # minus the penalty, per sample
    assert (shaping < 0).any() and metrics["critic/rewards/length_penalty"] < 0
    columns = torch.cat([SCORES, shaping[:, None]], dim=1)
    expected = gdpo_advantages(columns, GROUPS, torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(batch.advantages, expected)


def test_gdpo_refuses_an_agent_loops_own_reward_with_several_functions() -> None:
    problems = [Problem(prompt="p0", answer="yes", source="p0")]
    producer = RolloutProducer(
        TextQueueEngine([]),  # type: ignore[arg-type]
        CharTokenizer(),
        PromptStream(problems, 1, seed=0, shuffle=False),
        CORRECT.choice,
        RolloutSettings(
            group_size=2, max_new_tokens=8, temperature=1.0, top_p=1.0, adv_estimator="gdpo"
        ),
        run_seed=1,
        components=(CORRECT, SHORT),
    )
    gens = [Generation((1,), (ord("y"),), (0.0,), True)] * 2
    with pytest.raises(RewardMixError, match="set trajectory.reward for sample 1") as info:
        producer.score_groups(problems, gens, [[0], [0]], 3, own_rewards=[None, 1.0])
    assert "\n" not in str(info.value)


def test_the_command_line_takes_the_list_form() -> None:
    from megarl.train import compose_config

    cfg = compose_config(["data.reward=[{name: a, fn: gsm8k}, {fn: exact_match, weight: 0.5}]"])
    components = cfg.data.reward_components
    assert components is not None
    assert [(c.name, c.fn, c.weight) for c in components] == [
        ("a", "gsm8k", 1.0),
        ("exact_match", "exact_match", 0.5),
    ]


def test_dynamic_sampling_keeps_exactly_the_groups_gdpo_has_a_signal_for() -> None:
    """Weights 1 and 0.5: prompt 0 scores (1, 0) and (0, 2), equal weighted sums, which DAPO's
    filter on the sum would drop, but GDPO's advantages differ (+-0.35), so it is kept; prompt
    1 scores (0, 0) twice and is dropped; the second generation batch's first prompt fills the
    step."""
    short = WeightedReward("short", _fn_reward("m:s", lambda r, a: 2.0 * (len(r) <= 2)), 0.5)
    texts = ["yes...", "ok", "no...", "no...", "yes", "nope...", "yes", "nope..."]
    batch, metrics = _produce(
        "gdpo", (CORRECT, short), texts, num_prompts=4, prompts_per_step=2, filter_groups=True
    )
    assert metrics["train/filtered_groups"] == 1.0  # only prompt 1
    assert batch.rewards[:2].tolist() == [1.0, 1.0]  # equal sums, kept for GDPO
    assert batch.advantages[0] > 0 > batch.advantages[1]
    assert (batch.advantages != 0).all()


def test_gdpo_filter_drops_a_group_whose_scores_differ_but_cancel() -> None:
    """Equal weights: (1, 0) and (0, 1) normalise to +-a and -+a, which cancel: GDPO has no
    signal there, and the filter drops it though each function's scores differ."""
    short = WeightedReward("short", _fn_reward("m:s", lambda r, a: float(len(r) <= 2)), 1.0)
    texts = ["yes...", "ok", "yes", "nope..."]
    batch, metrics = _produce(
        "gdpo", (CORRECT, short), texts, num_prompts=2, prompts_per_step=1, filter_groups=True
    )
    assert metrics["train/filtered_groups"] == 1.0 and batch.num_seqs == 2
    assert batch.rewards.tolist() == [1.0, 0.0]  # prompt 1: "yes" and "nope..."

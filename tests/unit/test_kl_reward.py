"""KL in the reward: penalised token rewards, sequence scores, KL controllers, their gates and
config, on hand-made numbers.

The formulas written out here are verl's ``apply_kl_penalty`` (reward on the last response
token, ``- beta * kl_t`` on every response token) and the adaptive controller of Ziegler et al.
(2019), "Fine-Tuning Language Models from Human Preferences", section 2.2 (eq. 2):
``e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)``, ``beta_{t+1} = beta_t (1 + K_beta e_t)`` with
``K_beta = n_steps / horizon``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.algo.advantages import grpo_advantages
from megarl.algo.kl_reward import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    last_token_index,
    mean_sequence_kl,
    penalised_token_rewards,
    sequence_scores,
    token_kl,
)
from megarl.config.planning import run_facts
from megarl.config.schema import ConfigError, build_run_config
from megarl.planner.gate_results import OldLogProbSource, ReferenceSource
from megarl.planner.gates import (
    GateConfigError,
    StepFacts,
    decide_gates,
    decide_reference,
    validate_gate_config,
)

# Two sequences: 3 response tokens, then 2 (one pad).
OLD = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
REF = [[-1.5, -0.5, -1.0], [-0.1, -2.2, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
REWARDS = [1.0, 0.0]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _kl_by_hand(old: float, ref: float, kind: str) -> float:
    """Schulman's estimators of KL(old || ref) from one sampled token (k3 = low_var_kl,
    unclamped at these magnitudes)."""
    log_ratio = old - ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return math.exp(-log_ratio) + log_ratio - 1  # k3 / low_var_kl: e^{ref-old} - (ref-old) - 1


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_penalised_token_rewards_match_the_formula(kind: str) -> None:
    beta = 0.1
    kl_BT = token_kl(_t(OLD), _t(REF), _t(MASK), kind)
    rewards_BT = penalised_token_rewards(_t(REWARDS), kl_BT, _t(MASK), beta)
    expected = [[0.0] * 3 for _ in range(2)]
    for b in range(2):
        length = int(sum(MASK[b]))
        for t in range(length):
            expected[b][t] = -beta * _kl_by_hand(OLD[b][t], REF[b][t], kind)
        expected[b][length - 1] += REWARDS[b]
    torch.testing.assert_close(rewards_BT, _t(expected), rtol=0, atol=1e-12)
    assert rewards_BT[1, 2] == 0.0, "padding gets neither reward nor penalty"
    torch.testing.assert_close(sequence_scores(rewards_BT), _t(expected).sum(-1))


def test_k1_numbers_written_out() -> None:
    """k1 = old - ref: row 0 KL = (0.5, 0, -1), sum -0.5; row 1 (-0.2, 1.0), sum 0.8."""
    kl_BT = token_kl(_t(OLD), _t(REF), _t(MASK), "k1")
    scores = sequence_scores(penalised_token_rewards(_t(REWARDS), kl_BT, _t(MASK), 0.1))
    torch.testing.assert_close(scores, _t([1.0 + 0.05, 0.0 - 0.08]))
    # critic/kl: token means (-0.5/3, 0.8/2), then their mean
    assert mean_sequence_kl(kl_BT, _t(MASK)) == pytest.approx((-0.5 / 3 + 0.4) / 2)


def test_last_token_index_and_an_empty_row_keeps_its_reward() -> None:
    mask = _t([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 0]
    kl = torch.zeros(3, 4, dtype=torch.float64)
    scores = sequence_scores(penalised_token_rewards(_t([1.0, 2.0, 3.0]), kl, mask, 0.5))
    assert scores.tolist() == [1.0, 2.0, 3.0]


def test_zero_kl_leaves_rewards_bitwise_so_constant_groups_stay_exactly_zero() -> None:
    """Step 1 (actor == reference): KL is exactly 0, the scores are the rewards, and GRPO's
    constant groups are exactly 0, so zero-advantage pruning still applies."""
    rewards = torch.tensor([0.1, 0.1, 0.7, 0.3], dtype=torch.float32)
    logp = torch.tensor([[-0.3, -1.1], [-0.2, -0.9], [-0.5, -0.5], [-1.0, -2.0]])
    result = apply_kl_penalty(rewards, logp, logp, torch.ones(4, 2), "k1", FixedKLController(0.5))
    assert torch.equal(result.scores_B, rewards)
    assert grpo_advantages(result.scores_B, torch.tensor([0, 0, 1, 1]))[:2].tolist() == [0.0, 0.0]


def test_grpo_advantages_from_penalised_scores() -> None:
    """A group with equal rewards gets a signal from its KL alone: the sequence that drifted
    further from the reference gets the negative advantage."""
    rewards = torch.tensor([1.0, 1.0], dtype=torch.float64)
    old = _t([[-0.2, -0.2], [-0.2, -0.2]])
    ref = _t([[-0.2, -0.2], [-1.2, -0.2]])  # k1 per sequence: 0 and 1.0
    result = apply_kl_penalty(rewards, old, ref, torch.ones(2, 2), "k1", FixedKLController(0.1))
    torch.testing.assert_close(result.scores_B, _t([1.0, 0.9]))
    adv = grpo_advantages(result.scores_B, torch.tensor([0, 0]))
    # mean 0.95, unbiased std sqrt(2 * 0.05^2) = 0.0707107; (+-0.05) / (std + 1e-6)
    std = math.sqrt(2 * 0.05**2)
    torch.testing.assert_close(adv, _t([0.05 / (std + 1e-6), -0.05 / (std + 1e-6)]))
    assert result.current_kl == pytest.approx(0.25)  # token means 0 and 0.5
    assert result.beta == 0.1


def test_adaptive_controller_coefficients_by_hand() -> None:
    """Four updates of 8 sequences, horizon 100, target 0.1, K_beta = 8 / 100: KL 0.2 -> error
    1 clipped to 0.2; 0.09 -> -0.1; 0.1 -> 0 (on target); 0.0 -> -1 clipped to -0.2."""
    ctrl = AdaptiveKLController(value=0.01, target_kl=0.1, horizon=100)
    seen = []
    for kl in [0.2, 0.09, 0.1, 0.0]:
        ctrl.update(kl, n_steps=8)
        seen.append(ctrl.value)
    b1 = 0.01 * (1 + 0.2 * 0.08)
    b2 = b1 * (1 - 0.1 * 0.08)
    b3 = b2
    b4 = b3 * (1 - 0.2 * 0.08)
    assert seen == pytest.approx([b1, b2, b3, b4], rel=1e-12)
    assert seen == pytest.approx([0.01016, 0.01007872, 0.01007872, 0.00991746048], rel=1e-12)


def test_apply_kl_penalty_uses_beta_before_the_update() -> None:
    ctrl = AdaptiveKLController(value=0.5, target_kl=0.1, horizon=4)
    old, ref = _t([[-1.0], [-1.0]]), _t([[-2.0], [-1.0]])  # k1: 1.0 and 0.0, mean 0.5
    result = apply_kl_penalty(_t([0.0, 0.0]), old, ref, torch.ones(2, 1), "k1", ctrl)
    assert result.beta == 0.5
    torch.testing.assert_close(result.scores_B, _t([-0.5, 0.0]))
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 4))  # error clipped at +0.2


def test_fixed_controller_never_moves_and_state_round_trips() -> None:
    ctrl = build_kl_controller("fixed", 0.001, target_kl=0.1, horizon=10)
    for kl in [0.0, 5.0, 1e9]:
        ctrl.update(kl, n_steps=1000)
    assert ctrl.value == 0.001
    adaptive = build_kl_controller("adaptive", 0.3, target_kl=0.1, horizon=10)
    adaptive.update(1.0, n_steps=5)
    restored = build_kl_controller("adaptive", 0.3, target_kl=0.1, horizon=10)
    restored.load_state_dict(json.loads(json.dumps(adaptive.state_dict())))  # as checkpointed
    assert restored.value == adaptive.value == pytest.approx(0.33)


# --- config ----------------------------------------------------------------------------------


def test_config_defaults_are_verls() -> None:
    algo = build_run_config({}).algo
    assert (algo.use_kl_in_reward, algo.kl_penalty) == (False, "k1")
    assert (algo.kl_ctrl.type, algo.kl_ctrl.kl_coef) == ("fixed", 0.001)
    assert (algo.kl_ctrl.target_kl, algo.kl_ctrl.horizon) == (0.1, 10000)


@pytest.mark.parametrize(
    ("algo", "needle"),
    [
        ({"kl_penalty": "kl2"}, "algo.kl_penalty='kl2': must be one of k1, k2, k3, low_var_kl"),
        ({"kl_ctrl": {"type": "pid"}}, "algo.kl_ctrl.type='pid': must be one of fixed, adaptive"),
        ({"kl_ctrl": {"kl_coef": -0.1}}, "algo.kl_ctrl.kl_coef=-0.1: must be >= 0"),
        ({"kl_ctrl": {"target_kl": 0.0}}, "algo.kl_ctrl.target_kl=0.0: must be > 0"),
        ({"kl_ctrl": {"horizon": 0}}, "algo.kl_ctrl.horizon=0: must be > 0"),
        ({"kl_ctrl": {"horizon": 1.5}}, "algo.kl_ctrl.horizon=1.5: expected an integer"),
        ({"use_kl_in_reward": "yes"}, "algo.use_kl_in_reward='yes': expected true or false"),
        ({"kl_ctrl": {"beta": 1}}, "unknown config key algo.kl_ctrl.beta"),
    ],
)
def test_config_errors_name_the_key(algo: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_run_config({"algo": algo})
    assert needle in str(err.value) and "\n" not in str(err.value)


# --- gates -----------------------------------------------------------------------------------


def _kl_reward_run(**planner: str):
    return run_facts(build_run_config({"algo": {"use_kl_in_reward": True}, "planner": planner}))


def test_kl_in_reward_needs_the_reference_and_every_old_logprob() -> None:
    run = _kl_reward_run()
    assert run.kl_in_reward and run.kl_coef == 0.0
    plan = decide_reference(run)
    assert plan.source is ReferenceSource.MODEL
    assert "algo.use_kl_in_reward=true" in plan.reason
    gates = decide_gates(StepFacts(run=run, step=1, slices=((0, 1), (2, 3))))
    assert gates.ref_log_prob.run and gates.ref_log_prob.seq_indices == (0, 1, 2, 3)
    assert gates.ref_log_prob.reason == "algo.use_kl_in_reward=true"
    assert gates.old_log_prob.source is OldLogProbSource.RECOMPUTE
    assert gates.old_log_prob.seq_indices == (0, 1, 2, 3)  # on-policy slice 0 included
    assert "algo.use_kl_in_reward=true" in str(gates.metrics()["gates/reasons"])


def test_kl_in_reward_with_rollout_logprobs_keeps_them_as_old() -> None:
    run = _kl_reward_run(old_log_prob="rollout")
    gates = decide_gates(StepFacts(run=run, step=1, slices=((0, 1),)))
    assert gates.old_log_prob.source is OldLogProbSource.ROLLOUT and gates.ref_log_prob.run


def test_kl_in_reward_with_lora_uses_the_actor_without_adapters() -> None:
    cfg = build_run_config({"algo": {"use_kl_in_reward": True}, "actor": {"lora": {"rank": 4}}})
    assert decide_reference(run_facts(cfg)).source is ReferenceSource.ACTOR_WITHOUT_ADAPTERS


@pytest.mark.parametrize(
    ("planner", "needle"),
    [
        ({"ref_log_prob": "never"}, "planner.ref_log_prob=never contradicts"),
        ({"old_log_prob": "never"}, "planner.old_log_prob=never contradicts"),
    ],
)
def test_forced_off_passes_are_refused_at_start_up(planner: dict, needle: str) -> None:
    with pytest.raises(GateConfigError) as err:
        validate_gate_config(_kl_reward_run(**planner))
    assert needle in str(err.value) and "algo.use_kl_in_reward=true" in str(err.value)

"""Asynchronous training on plain data: its config keys and refusals, the gates' reasons with
behaviour versions, and the decoupled loss against its formula.

Decoupled PPO (AReaL; verl's rollout correction in "decoupled" mode) is megarl's policy loss
with the rollout correction on: PPO's ratio against the proximal policy (the trainer's weights
at the start of the step: the old logprobs the gates provide) and each token's loss weighed by
the truncated ``pi_prox / pi_behaviour`` (the correction's ``pi_old / pi_rollout``).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.config import config_refusal

from megarl.algo.losses import policy_loss
from megarl.algo.rollout_correction import CorrectionSettings, compute_correction
from megarl.config import planning
from megarl.config.schema import build_run_config
from megarl.planner.gates import decide_gates

SPLIT = {"rollout": {"n_gpus": 1}, "trainer": {"launcher": "ray"}}


def _config(mode: str = "fully_async", **sections):
    tree = {**SPLIT, "async_training": {"mode": mode}}
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return build_run_config(tree)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"async_training": {"mode": "fully_async"}},
            (
                "async_training.mode=fully_async overlaps generation with training, which needs "
                "the engine on devices of its own: set rollout.n_gpus > 0"
            ),
        ),
        (
            {**SPLIT, "async_training": {"mode": "one_step_off", "max_staleness": 3}},
            "one_step_off is staleness 1 by definition",
        ),
        (
            {**SPLIT, "async_training": {"mode": "one_step_off", "partial_rollout": True}},
            "partial_rollout=true needs async_training.mode=fully_async",
        ),
        (
            {
                "rollout": {"n_gpus": 1, "sleep_level": 2},
                "trainer": {"launcher": "ray"},
                "async_training": {"mode": "fully_async"},
            },
            "rollout.sleep_level=2, but the engine generates while the trainer trains",
        ),
        (
            {
                **SPLIT,
                "async_training": {"mode": "fully_async"},
                "algo": {"filter_groups": {"enable": True}},
            },
            "algo.filter_groups (DAPO's dynamic sampling) runs only in the synchronous loop",
        ),
        (
            {
                "rollout": {"n_gpus": 1, "max_num_seqs": 4},
                "trainer": {"launcher": "ray"},
                "async_training": {"mode": "fully_async"},
            },
            "rollout.max_num_seqs=4 is below rollout.n=8",
        ),
        (
            {
                **SPLIT,
                "async_training": {"mode": "fully_async"},
                "algo": {"rollout_correction": {"rollout_is": None}},
            },
            "trains tokens up to 1 version(s) old, but algo.rollout_correction has neither",
        ),
        (
            {**SPLIT, "async_training": {"mode": "fully_async", "max_staleness": -1}},
            "async_training.max_staleness=-1: must be >= 0",
        ),
        (
            {"algo": {"rollout_correction": {"bypass_mode": True, "rollout_is": "token"}}},
            "would compare them with themselves",
        ),
        (
            {"async_training": {"mode": "sometimes"}},
            "async_training.mode='sometimes': must be one of sync, one_step_off, fully_async",
        ),
    ],
)
def test_refusals_are_one_line_naming_the_keys(tree, message):
    assert message in config_refusal(tree)


def test_the_correction_defaults_to_token_is_exactly_where_tokens_may_be_stale():
    assert build_run_config({}).algo.rollout_correction.rollout_is is None  # sync
    assert _config().algo.rollout_correction.rollout_is == "token"
    assert _config("one_step_off").algo.rollout_correction.rollout_is == "token"
    at_zero = _config(async_training={"max_staleness": 0})
    assert at_zero.algo.rollout_correction.rollout_is is None  # trains like sync
    bypass = _config(algo={"rollout_correction": {"bypass_mode": True}})
    assert bypass.algo.rollout_correction.rollout_is is None
    assert planning.old_log_prob_mode(bypass).value == "rollout"
    rejection_only = _config(
        algo={"rollout_correction": {"rollout_is": None, "rollout_rs": "token"}}
    )
    assert rejection_only.algo.rollout_correction.rollout_rs == "token"
    chosen = _config(algo={"rollout_correction": {"rollout_is": "sequence"}})
    assert chosen.algo.rollout_correction.rollout_is == "sequence"


def _gates(cfg, versions, step, mini_batches=1):
    import dataclasses

    cfg = dataclasses.replace(
        cfg, actor=dataclasses.replace(cfg.actor, ppo_mini_batches=mini_batches)
    )
    return decide_gates(planning.step_facts(cfg, step, len(versions), behaviour_versions=versions))


def test_stale_sequences_take_the_proximal_logprobs_from_the_first_training_forward():
    cfg = _config()
    gates = _gates(cfg, [6] * 8, step=8)  # trainer version 7
    assert not gates.old_log_prob.run
    assert gates.old_log_prob.reason == "proximal; behaviour version 6 < trainer 7"
    mixed = _gates(cfg, [5, 6, 7, 7], step=8)
    assert mixed.old_log_prob.reason == "proximal; behaviour versions 5-6 < trainer 7"
    fresh = _gates(cfg, [7] * 4, step=8)
    assert "on-policy" in fresh.old_log_prob.reason


def test_a_slice_after_an_optimizer_step_is_recomputed_whatever_its_versions():
    gates = _gates(_config(), [6, 6, 7, 7], step=8, mini_batches=2)
    assert gates.old_log_prob.seq_indices == (2, 3)  # the window rule: mb1, though fresh
    assert gates.old_log_prob.reason == "mb1 after step; behaviour version 6 < trainer 7"


def test_versions_newer_than_the_trainer_or_of_the_wrong_count_are_refused():
    cfg = _config()
    with pytest.raises(ValueError, match="above the trainer's 7"):
        _gates(cfg, [8, 7], step=8)
    with pytest.raises(ValueError, match="3 behaviour versions for 4 sequences"):
        decide_gates(planning.step_facts(cfg, 8, 4, behaviour_versions=[7, 7, 7]))


# --- the decoupled loss -------------------------------------------------------------------------


def _loss_and_grad(logp_BT, prox_BT, behaviour_BT, adv_B, mask_BT, settings):
    logp_BT = logp_BT.clone().requires_grad_(True)
    weights = None
    if settings is not None:
        weights = compute_correction(prox_BT, behaviour_BT, mask_BT, settings).token_weights_BT
    out = policy_loss(logp_BT, prox_BT, adv_B, mask_BT, 0.2, 0.28, token_weights_BT=weights)
    out.loss.backward()
    return out.loss.detach(), logp_BT.grad


def _tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    prox_BT = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    logp_BT = prox_BT + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask_BT = torch.tensor(
        [[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]], dtype=torch.float64
    )
    adv_B = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)
    return logp_BT, prox_BT, adv_B, mask_BT


def test_decoupled_loss_with_behaviour_equal_to_proximal_is_the_on_policy_loss_bitwise():
    logp_BT, prox_BT, adv_B, mask_BT = _tokens(0)
    token_is = CorrectionSettings(rollout_is="token", is_threshold=2.0)
    decoupled = _loss_and_grad(logp_BT, prox_BT, prox_BT.clone(), adv_B, mask_BT, token_is)
    on_policy = _loss_and_grad(logp_BT, prox_BT, None, adv_B, mask_BT, None)
    assert torch.equal(decoupled[0], on_policy[0])
    assert torch.equal(decoupled[1], on_policy[1])


def test_decoupled_loss_is_the_formula():
    """AReaL's decoupled objective per token: ``-min(pi_prox / pi_behaviour, C) *
    min(r A, clip(r, 1 - lo, 1 + hi) A)`` with ``r = pi / pi_prox`` (dual clip off for the
    positive advantages; the negative one is within it here), token-mean."""
    logp_BT, prox_BT, adv_B, mask_BT = _tokens(1)
    g = torch.Generator().manual_seed(2)
    behaviour_BT = prox_BT + 0.8 * torch.randn(prox_BT.shape, generator=g, dtype=torch.float64)
    token_is = CorrectionSettings(rollout_is="token", is_threshold=2.0)
    loss, _ = _loss_and_grad(logp_BT, prox_BT, behaviour_BT, adv_B, mask_BT, token_is)
    total = 0.0
    for b in range(3):
        for t in range(5):
            if not mask_BT[b, t]:
                continue
            ratio = math.exp(float(logp_BT[b, t] - prox_BT[b, t]))
            advantage = float(adv_B[b])
            surrogate = min(ratio * advantage, min(max(ratio, 0.8), 1.28) * advantage)
            weight = min(math.exp(float(prox_BT[b, t] - behaviour_BT[b, t])), 2.0)
            total += -weight * surrogate
    assert loss.item() == pytest.approx(total / mask_BT.sum().item(), rel=1e-12)
    truncated = (prox_BT - behaviour_BT).exp() > 2.0
    assert bool((truncated & (mask_BT > 0)).any())  # some weights are truncated

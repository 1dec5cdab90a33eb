"""Skipping work never changes the math: pruned == unpruned and gated == recomputed, in numbers.

Each test trains the tiny model for 3 GRPO steps twice from the same seed (so the rollouts are
the same) and compares the final parameters (max abs diff <= 1e-6, fp32, Adam).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

# lr 1e-4: parameters move by ~1e-4 per step (far above the 1e-6 tolerance, checked below)
# while float rounding from different micro-batch shapes stays far below it.
COMMON = {"data.reward": "synthetic_rewards:mixed_groups", "actor.lr": 1e-4}
# Pruning regroups the kept sequences into other (fewer, fuller) micro-batches than `off`
# trains, so the runs sum the same gradient in another order. Adam scales that rounding on
# near-zero gradient entries up to lr-sized steps. Measured after 3 steps in the packed layout
# (the default): match_loss_curve 0.0 (2 mini-batches), fast with 1 mini-batch 2.1e-6 (1.7e-7
# padded). So that one equality is checked padded; packed == padded is proven separately in
# test_packing.py. With mixed mini-batches match_loss_curve gave 2.3e-6 after step 1 alone (grad
# norms equal to 1e-9 relative): Adam's m / sqrt(v) is +-1 on an entry whose gradient is
# rounding noise far below eps = 1e-8. At eps = 1e-6 the update there is linear in that noise,
# while every gradient above 1e-6 still moves its weight by lr: 1.1e-7.
PADDED = {"actor.pack_sequences": "false"}
ADAM_EPS = {"actor.optim.eps": 1e-6}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _train(tiny_run, **overrides):
    result = tiny_run(steps=3, return_final_state=True, **{**COMMON, **overrides})
    return result.final_state, result.history


def _assert_moved(history, final_state, tmp_path):
    """Training really changed the weights, by much more than the equality tolerance."""
    from megarl.models.hf_io import load_hf_state_dict

    assert any(row["actor/grad_norm"] > 0 for row in history), "nothing was trained"
    initial = load_hf_state_dict(tmp_path / "run" / "init_model")
    assert _max_diff(final_state, initial) > 1e-4


@pytest.mark.parametrize(
    "layout",
    [
        {"actor.policy_loss": "gspo"},
        {"trainer.n_gpus_per_node": 2},
        {"actor.tp": 2, "trainer.n_gpus_per_node": 2},
    ],
    ids=["dp1-gspo", "dp2", "tp2"],
)
def test_match_loss_curve_equals_off(tiny_run, tmp_path, layout):
    """At dp1 with GSPO and its aggregation, seq-mean-token-mean, in packed micro-batches: the
    sequence ratio and the ``1 / length`` weights are taken per packed sequence, so regrouping
    the kept sequences changes nothing. (Every loss x aggregation is proven on plain tensors in
    tests/unit/test_losses.py.)"""
    batching = {"actor.ppo_mini_batches": 2, **layout}
    base, base_hist = _train(tiny_run, **batching, **{"planner.prune_zero_adv": "off"})
    pruned, hist = _train(tiny_run, **batching, **{"planner.prune_zero_adv": "match_loss_curve"})
    _assert_moved(base_hist, base, tmp_path)
    assert [r["critic/rewards/mean"] for r in hist] == [r["critic/rewards/mean"] for r in base_hist]
    assert any(r["planner/kept_seq_frac"] < 1 for r in hist), "nothing was pruned"
    assert (
        _max_diff(base, pruned) <= 1e-6
    )  # measured 1.1e-7 (2.3e-6 at Adam's default eps)  # measured 0.0 at dp1, dp2 and tp2


def test_fast_with_one_mini_batch_equals_off(tiny_run, tmp_path):
    # Adam's eps as below: at the default 1e-8 an entry whose gradient is rounding noise moves
    # by +-lr (measured 1.7e-7 on one CPU, 1.6e-6 on another with other GEMM kernels; 1.1e-7
    # at 1e-6)
    settings = {**PADDED, **ADAM_EPS}
    base, base_hist = _train(tiny_run, **settings, **{"planner.prune_zero_adv": "off"})
    fast, hist = _train(tiny_run, **settings, **{"planner.prune_zero_adv": "fast"})
    _assert_moved(base_hist, base, tmp_path)
    assert any(r["planner/kept_seq_frac"] < 1 for r in hist)
    assert _max_diff(base, fast) <= 1e-6


@pytest.mark.parametrize("mini_batches", [1, 2], ids=["on-policy", "two-mini-batches"])
def test_old_logprob_gate_auto_equals_always(tiny_run, tmp_path, mini_batches):
    batching = {"actor.ppo_mini_batches": mini_batches}
    always, always_hist = _train(tiny_run, **batching, **{"planner.old_log_prob": "always"})
    auto, hist = _train(tiny_run, **batching, **{"planner.old_log_prob": "auto"})
    _assert_moved(always_hist, always, tmp_path)
    expected_frac = 0.0 if mini_batches == 1 else 0.5
    assert all(r["gates/old_log_prob_frac"] == expected_frac for r in hist)
    assert all(r["gates/old_log_prob_frac"] == 1.0 for r in always_hist)
    assert _max_diff(always, auto) <= 1e-6


def test_old_logprob_gate_follows_fast_merged_steps(tiny_run, tmp_path):
    """`fast` merges the 2 mini-batches into fewer optimizer steps; the gate recomputes only
    what is consumed after one of those steps (nothing when they merged into one), and the
    result still equals recomputing everything."""
    batching = {"actor.ppo_mini_batches": 2, "planner.prune_zero_adv": "fast"}
    always, always_hist = _train(tiny_run, **batching, **{"planner.old_log_prob": "always"})
    auto, hist = _train(tiny_run, **batching, **{"planner.old_log_prob": "auto"})
    _assert_moved(always_hist, always, tmp_path)
    merged = [r["planner/optimizer_steps"] == 1 for r in hist]
    assert any(merged), "no step merged its mini-batches"
    for row, one_step in zip(hist, merged, strict=True):
        assert (row["gates/old_log_prob_frac"] == 0.0) is one_step, row["gates/reasons"]
    assert _max_diff(always, auto) <= 1e-6


def test_dp4_with_few_kept_sequences_completes(tiny_run):
    """Fewer kept sequences than DP ranks: fillers keep every rank busy, nothing hangs.

    2 prompts x 2 samples over 4 DP ranks; ``mixed_groups`` prunes the even-answer group, so 2
    sequences are kept (a GRPO group's advantages sum to 0, so a kept group has at least 2
    members; a single kept sequence is covered by the planner's unit tests) and 2 ranks train a
    zero-weight filler. The seed is one whose step-1 rollout keeps exactly one group (its
    responses have both length parities, the other group's do not) with ``model=tiny_llama``;
    step 2 samples from the trained weights, so only its completion is asserted.
    """
    result = tiny_run(
        steps=2,
        **{
            **COMMON,
            "trainer.n_gpus_per_node": 4,
            "rollout.n": 2,
            "data.prompts_per_step": 2,
            "trainer.seed": 1234,
            "planner.prune_zero_adv": "match_loss_curve",
        },
    )
    assert len(result.history) == 2
    first = result.history[0]
    assert first["planner/kept_seq_frac"] == 0.5
    assert first["planner/filler_seqs"] == 2
    assert first["planner/num_micro_batches"] == 4  # one per rank


def _kept_groups_at_step_1(dump_dir) -> list[bool]:
    """Which groups step 1 trained, from the run's generations dump (its ``trained`` flags)."""
    import json

    rows = [json.loads(line) for line in (dump_dir / "1.jsonl").read_text().splitlines()]
    groups = sorted({row["group"] for row in rows})
    return [any(row["trained"] for row in rows if row["group"] == g) for g in groups]


def test_match_loss_curve_equals_off_with_mixed_mini_batches(tiny_run, tmp_path):
    """Kept and pruned groups share a mini-batch, which is split into several micro-batches.

    4 prompts x 4 samples in 2 mini-batches of 2 groups each; ``mixed_groups`` prunes the
    even-answer groups (and odd-answer groups whose responses happen to share a length parity).
    At step 1 a mini-batch holds a kept and a pruned group (checked from the run's generations
    dump), so it trains one group and prunes the other: its loss is normalised by the unpruned
    mini-batch's token count while its micro-batches are packed differently from the
    baseline's. (The tiny model collapses to one response after that step; later steps are
    ghost steps.)
    """
    batching = {
        "actor.ppo_mini_batches": 2,
        "data.prompts_per_step": 4,
        "actor.micro_batch_tokens": 160,
        **ADAM_EPS,
    }
    base, base_hist = _train(tiny_run, **batching, **{"planner.prune_zero_adv": "off"})
    dump = {"trainer.rollout_data_dir": str(tmp_path / "dump")}
    pruned, hist = _train(
        tiny_run, **batching, **dump, **{"planner.prune_zero_adv": "match_loss_curve"}
    )
    kept_groups = _kept_groups_at_step_1(tmp_path / "dump")
    mini_batches = [kept_groups[:2], kept_groups[2:]]
    assert any(any(mb) and not all(mb) for mb in mini_batches), "no mixed mini-batch to test"
    _assert_moved(base_hist, base, tmp_path)
    assert hist[0]["planner/kept_seq_frac"] == sum(kept_groups) / len(kept_groups)
    assert base_hist[0]["planner/num_micro_batches"] > 2, "one micro-batch per mini-batch"
    assert _max_diff(base, pruned) <= 1e-6  # measured 1.1e-7 (2.3e-6 at Adam's default eps)

"""Batch planner: invariants on hand-made and random batches, pruning rules, balance bounds."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.planner.batch_planner import plan_step
from megarl.planner.inputs import LOSS_AGG_MODES, LossTerms, PlannerError, PlannerInputs
from megarl.planner.optimizer_steps import merge_into_runs, normaliser_of
from megarl.planner.partition import (
    balanced_partition,
    first_fit_decreasing,
    sequence_costs,
    split_in_two,
)
from megarl.planner.pruning import check_pruning_config
from megarl.planner.step_plan import MicroBatch, OptimizerStepPlan, RankPlan, StepPlan

METRIC_KEYS = {
    "planner/kept_seq_frac",
    "planner/kept_token_frac",
    "planner/dp_imbalance",
    "planner/num_micro_batches",
    "planner/ghost_steps",
    "planner/filler_seqs",
    "planner/optimizer_steps",
}


# ----------------------------------------------------------------------------- invariants


def kept_mask(inputs: PlannerInputs) -> list[bool]:
    if inputs.mode == "off":
        return [True] * inputs.num_sequences
    return [adv != 0 for adv in inputs.advantages]


def covered_members(inputs: PlannerInputs, step: OptimizerStepPlan) -> range:
    size = inputs.num_sequences // inputs.ppo_mini_batches
    return range(step.source_mini_batches[0] * size, (step.source_mini_batches[-1] + 1) * size)


def unpruned_count(inputs: PlannerInputs, members: range) -> float:
    if inputs.loss_agg == "token-mean":
        return float(sum(inputs.response_tokens[i] for i in members))
    if inputs.loss_agg == "seq-mean-token-sum-norm":
        return float(len(members)) * inputs.loss_scale_factor
    return float(len(members))


def assert_step_order(inputs: PlannerInputs, plan: StepPlan) -> None:
    """Epoch-major order; off/match: one step per mini-batch; fast: contiguous covering runs."""
    num_mini_batches = inputs.ppo_mini_batches
    by_epoch: dict[int, list[OptimizerStepPlan]] = {}
    for step in plan.optimizer_steps:
        by_epoch.setdefault(step.epoch, []).append(step)
    assert sorted(by_epoch) == list(range(inputs.ppo_epochs))
    assert [s.epoch for s in plan.optimizer_steps] == sorted(s.epoch for s in plan.optimizer_steps)
    first_runs = [s.source_mini_batches for s in by_epoch[0]]
    for steps in by_epoch.values():
        assert [s.source_mini_batches for s in steps] == first_runs  # same every epoch
        assert [s.mini_batch for s in steps] == list(range(len(steps)))
    assert [m for run in first_runs for m in run] == list(range(num_mini_batches))
    if inputs.mode != "fast":
        assert first_runs == [(m,) for m in range(num_mini_batches)]


def assert_micro_batch(inputs: PlannerInputs, micro_batch: MicroBatch) -> None:
    tokens = [inputs.seq_tokens[i] for i in micro_batch.seq_indices]
    assert micro_batch.num_tokens == sum(tokens)
    if len(tokens) > 1:
        assert micro_batch.num_tokens <= inputs.micro_batch_tokens


def assert_filler_choice(inputs: PlannerInputs, members: range, filler: int) -> None:
    """Shortest zero-adv of the step's mini-batches, else of the batch, else any (weight 0)."""
    zero_in_step = [i for i in members if inputs.advantages[i] == 0]
    zero_anywhere = [i for i in range(inputs.num_sequences) if inputs.advantages[i] == 0]
    pool = zero_in_step or zero_anywhere
    if pool:
        assert filler == min(pool, key=lambda i: (inputs.seq_tokens[i], i))


def assert_invariants(inputs: PlannerInputs, plan: StepPlan) -> None:
    """Every invariant of the module docstring, checked from first principles."""
    kept = kept_mask(inputs)
    assert_step_order(inputs, plan)
    trained_per_epoch: dict[int, Counter[int]] = {e: Counter() for e in range(inputs.ppo_epochs)}
    for step in plan.optimizer_steps:
        members = covered_members(inputs, step)
        assert len(step.ranks) == inputs.dp_size
        assert step.normaliser == unpruned_count(inputs, members)
        assert step.is_ghost == (not any(kept[i] for i in members))
        counts = {rank.num_micro_batches for rank in step.ranks}
        assert counts == ({0} if step.is_ghost else {step.num_micro_batches_per_rank})
        assert step.is_ghost or step.num_micro_batches_per_rank >= 1
        for rank in step.ranks:
            for micro_batch in rank.micro_batches:
                assert_micro_batch(inputs, micro_batch)
                for seq, weight in zip(
                    micro_batch.seq_indices, micro_batch.loss_weights, strict=True
                ):
                    if weight == 1.0:
                        assert seq in members and kept[seq]
                        trained_per_epoch[step.epoch][seq] += 1
                    else:
                        assert_filler_choice(inputs, members, seq)
    expected = Counter({i: 1 for i in range(inputs.num_sequences) if kept[i]})
    for counter in trained_per_epoch.values():
        assert counter == expected
    if inputs.mode == "off":
        assert plan.num_ghost_steps == 0
        assert plan.num_kept_sequences == inputs.num_sequences
    assert plan.num_kept_sequences == sum(kept)
    assert set(plan.metrics) == METRIC_KEYS
    assert plan.dp_imbalance >= 1.0 - 1e-9
    assert plan.approximate == (inputs.mode != "off" and inputs.loss_terms.kl_or_entropy)


# ----------------------------------------------------------------------------- helpers


def make_inputs(
    seq_tokens: list[int],
    advantages: list[float],
    group_size: int = 2,
    response_tokens: list[int] | None = None,
    **overrides,
) -> PlannerInputs:
    return PlannerInputs(
        seq_tokens=seq_tokens,
        response_tokens=response_tokens or [max(0, t - 3) for t in seq_tokens],
        advantages=advantages,
        group_ids=[i // group_size for i in range(len(seq_tokens))],
        **overrides,
    )


def trained_by_rank(step: OptimizerStepPlan) -> list[list[int]]:
    return [
        sorted(
            seq
            for mb in rank.micro_batches
            for seq, weight in zip(mb.seq_indices, mb.loss_weights, strict=True)
            if weight == 1.0
        )
        for rank in step.ranks
    ]


def lognormal_inputs(
    num_sequences: int, dp_size: int, seed: int, zero_frac: float = 0.75, group_size: int = 16
) -> PlannerInputs:
    rng = np.random.default_rng(seed)
    seq_tokens = np.clip(rng.lognormal(np.log(1000) - 0.32, 0.8, num_sequences), 16, 8192)
    seq_tokens = seq_tokens.astype(np.int64)
    groups = np.arange(num_sequences) // group_size
    group_is_zero = rng.random(num_sequences // group_size + 1) < zero_frac
    advantages = np.where(group_is_zero[groups], 0.0, rng.normal(size=num_sequences))
    return PlannerInputs(
        seq_tokens=seq_tokens,
        response_tokens=np.maximum(1, seq_tokens * 3 // 4),
        advantages=advantages,
        group_ids=groups,
        dp_size=dp_size,
        micro_batch_tokens=16384,
        mode="match_loss_curve",
    )


# ----------------------------------------------------------------------------- validation


def test_batch_not_divisible_by_mini_batches_names_the_field() -> None:
    with pytest.raises(ValueError) as excinfo:
        make_inputs([10] * 12, [1.0] * 12, ppo_mini_batches=5)
    assert str(excinfo.value) == (
        "rollout batch of 12 sequences is not divisible by actor.ppo_mini_batches=5"
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dp_size": 0}, "dp_size"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"ppo_mini_batches": 0}, "ppo_mini_batches"),
        ({"micro_batch_tokens": -1}, "micro_batch_tokens"),
        ({"mode": "faster"}, "mode"),
        ({"loss_agg": "seq-mean"}, "loss_agg"),
        ({"attention_cost_coef": -1.0}, "attention_cost_coef"),
        ({"loss_scale_factor": 0.0}, "loss_scale_factor"),
        ({"loss_scale_factor": float("inf")}, "loss_scale_factor"),
    ],
)
def test_bad_settings_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(PlannerError, match=field):
        make_inputs([10, 10], [1.0, 0.0], **overrides)


@pytest.mark.parametrize("field", ["kl_coef", "entropy_coef", "moe_aux_loss_coef", "echo_coef"])
def test_non_finite_loss_coefficients_name_the_field(field: str) -> None:
    with pytest.raises(PlannerError, match=f"{field} must be finite, got nan"):
        replace(LossTerms(), **{field: float("nan")})


def test_bad_per_sequence_values_name_field_and_index() -> None:
    with pytest.raises(PlannerError, match=r"advantages has 1 entries but seq_tokens has 2"):
        make_inputs([10, 10], [1.0])
    with pytest.raises(PlannerError, match=r"seq_tokens\[1\]=0"):
        make_inputs([10, 0], [1.0, 0.0], response_tokens=[5, 0])
    with pytest.raises(PlannerError, match=r"response_tokens\[0\]=11 exceeds seq_tokens"):
        make_inputs([10, 10], [1.0, 0.0], response_tokens=[11, 5])
    with pytest.raises(PlannerError, match=r"advantages\[1\]=nan must be finite"):
        make_inputs([10, 10], [1.0, float("nan")])
    with pytest.raises(PlannerError, match="seq_tokens must hold integers"):
        make_inputs([10.5, 10.0], [1.0, 0.0], response_tokens=[5, 5])
    with pytest.raises(PlannerError, match="empty"):
        make_inputs([], [])


def test_inputs_are_stored_as_tuples_and_numpy_equals_lists() -> None:
    from_lists = make_inputs([5, 6, 7, 8], [0.0, 1.0, 0.0, -1.0], mode="match_loss_curve")
    from_arrays = PlannerInputs(
        seq_tokens=np.array([5, 6, 7, 8]),
        response_tokens=np.array([2, 3, 4, 5]),
        advantages=np.array([0.0, 1.0, 0.0, -1.0]),
        group_ids=np.array([0, 0, 1, 1]),
        mode="match_loss_curve",
        dp_size=np.int64(1),
    )
    assert from_arrays == from_lists
    assert isinstance(from_arrays.seq_tokens, tuple)
    assert plan_step(from_arrays) == plan_step(from_lists)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", ["match_loss_curve", "fast"])
def test_pruning_with_kl_or_entropy_fails_naming_the_settings(mode: str) -> None:
    for kl, ent in [(0.1, 0.0), (0.0, 0.01)]:
        with pytest.raises(PlannerError) as excinfo:
            check_pruning_config(mode, LossTerms(kl_coef=kl, entropy_coef=ent), False)
        message = str(excinfo.value)
        for name in ("planner.prune_zero_adv", "actor.kl_coef", "actor.entropy_coef"):
            assert name in message
        with pytest.raises(PlannerError, match="planner.prune_zero_adv"):
            plan_step(
                make_inputs(
                    [10] * 4,
                    [0.0, 0.0, 1.0, -1.0],
                    mode=mode,
                    loss_terms=LossTerms(kl_coef=kl, entropy_coef=ent),
                )
            )


def test_pruning_config_exact_cases_return_none() -> None:
    kl_and_entropy = LossTerms(kl_coef=0.1, entropy_coef=0.1)
    assert check_pruning_config("off", kl_and_entropy, allow_approx=False) is None
    assert check_pruning_config("fast", LossTerms(), allow_approx=False) is None
    with pytest.raises(PlannerError, match="planner.prune_zero_adv"):
        check_pruning_config("sometimes", LossTerms(), allow_approx=False)


def test_allow_approx_prunes_and_marks_the_plan() -> None:
    inputs = make_inputs(
        [10] * 4,
        [0.0, 0.0, 1.0, -1.0],
        mode="match_loss_curve",
        loss_terms=LossTerms(kl_coef=0.1),
        allow_approx=True,
    )
    plan = plan_step(inputs)
    assert plan.approximate
    assert any("actor.kl_coef=0.1" in reason for reason in plan.reasons)
    assert plan.num_kept_sequences == 2
    assert "APPROX" in plan.summary()
    assert_invariants(inputs, plan)


def test_off_mode_with_kl_is_exact_and_trains_everything() -> None:
    inputs = make_inputs(
        [10] * 4, [0.0, 0.0, 1.0, -1.0], mode="off", loss_terms=LossTerms(kl_coef=0.1)
    )
    plan = plan_step(inputs)
    assert not plan.approximate
    assert plan.num_kept_sequences == 4
    assert_invariants(inputs, plan)


# ----------------------------------------------------------------------------- modes


def test_off_mode_contiguous_mini_batches_and_normalisers() -> None:
    seq_tokens = [10, 20, 30, 40, 50, 60, 70, 80]
    response = [1, 2, 3, 4, 5, 6, 7, 8]
    inputs = make_inputs(
        seq_tokens,
        [0.0] * 8,
        response_tokens=response,
        ppo_mini_batches=2,
        ppo_epochs=2,
        dp_size=2,
    )
    plan = plan_step(inputs)
    assert [(s.epoch, s.mini_batch) for s in plan.optimizer_steps] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert [s.normaliser for s in plan.optimizer_steps] == [10.0, 26.0, 10.0, 26.0]
    trained = [i for rank in trained_by_rank(plan.optimizer_steps[1]) for i in rank]
    assert sorted(trained) == [4, 5, 6, 7]
    assert plan.num_ghost_steps == 0
    assert_invariants(inputs, plan)
    seq_mean = plan_step(
        make_inputs(seq_tokens, [0.0] * 8, ppo_mini_batches=2, loss_agg="seq-mean-token-sum")
    )
    assert [s.normaliser for s in seq_mean.optimizer_steps] == [4.0, 4.0]
    token_mean_per_seq = plan_step(
        make_inputs(seq_tokens, [0.0] * 8, ppo_mini_batches=2, loss_agg="seq-mean-token-mean")
    )
    assert [s.normaliser for s in token_mean_per_seq.optimizer_steps] == [4.0, 4.0]
    dr_grpo = plan_step(
        make_inputs(
            seq_tokens,
            [0.0] * 8,
            ppo_mini_batches=2,
            loss_agg="seq-mean-token-sum-norm",
            loss_scale_factor=16.0,
        )
    )
    assert [s.normaliser for s in dr_grpo.optimizer_steps] == [64.0, 64.0]  # 4 seqs x 16


def test_normaliser_of_each_aggregation() -> None:
    assert normaliser_of([3, 5, 0], "token-mean") == 8.0
    assert normaliser_of([3, 5, 0], "seq-mean-token-sum") == 3.0
    assert normaliser_of([3, 5, 0], "seq-mean-token-mean") == 3.0
    assert normaliser_of([3, 5, 0], "seq-mean-token-sum-norm", 512.0) == 3 * 512.0
    with pytest.raises(PlannerError, match="loss_agg must be one of"):
        normaliser_of([3], "sum")


def test_match_loss_curve_keeps_steps_prunes_and_ghosts() -> None:
    # mini-batch 0: group 0 all-equal, group 1 mixed; mini-batch 1: both groups all-equal
    advantages = [0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    inputs = make_inputs(
        [100] * 8, advantages, ppo_mini_batches=2, dp_size=2, mode="match_loss_curve"
    )
    plan = plan_step(inputs)
    step0, step1 = plan.optimizer_steps
    assert trained_by_rank(step0) == [[2], [3]]
    assert step0.normaliser == 4 * 97  # unpruned: all four sequences' response tokens
    assert step1.is_ghost and step1.normaliser == 4 * 97
    assert all(rank.micro_batches == () for rank in step1.ranks)
    assert "mini-batch 1 has no kept sequence: ghost step" in plan.reasons
    assert "pruned 6/8 zero-adv seqs (3 of 4 groups all-equal)" in plan.reasons
    assert plan.summary() == "keep 2/8 seq (25% tok) | 2 steps (1 ghost) | 1 mb/rank | imb 1.00"
    assert_invariants(inputs, plan)


def test_fast_with_one_mini_batch_equals_match_loss_curve() -> None:
    inputs = lognormal_inputs(256, dp_size=4, seed=3)
    match = plan_step(inputs)
    fast = plan_step(PlannerInputs(**{**vars(inputs), "mode": "fast"}))
    assert fast.optimizer_steps == match.optimizer_steps
    assert_invariants(inputs, match)


def test_fast_merges_mini_batches_into_one_step_when_kept_tokens_fit() -> None:
    advantages = [0.0, 0.0, 1.0, -1.0] * 4  # half the tokens kept, 4 mini-batches
    inputs = make_inputs(
        [50] * 16,
        advantages,
        ppo_mini_batches=4,
        ppo_epochs=2,
        mode="fast",
        dp_size=2,
        loss_agg="seq-mean-token-sum",
    )
    plan = plan_step(inputs)
    # kept tokens = 400 of 800; one baseline mini-batch holds 200 -> two merged steps per epoch
    assert [s.source_mini_batches for s in plan.optimizer_steps] == [(0, 1), (2, 3)] * 2
    assert [s.normaliser for s in plan.optimizer_steps] == [8.0] * 4
    assert "fast: merged 4 mini-batches into 2 step(s) per epoch" in plan.reasons
    assert_invariants(inputs, plan)


def test_fast_with_nothing_kept_is_one_ghost_step_per_epoch() -> None:
    inputs = make_inputs([50] * 8, [0.0] * 8, ppo_mini_batches=4, ppo_epochs=3, mode="fast")
    plan = plan_step(inputs)
    assert [s.source_mini_batches for s in plan.optimizer_steps] == [(0, 1, 2, 3)] * 3
    assert plan.num_ghost_steps == 3
    assert plan.metrics["planner/num_micro_batches"] == 0
    assert_invariants(inputs, plan)


def test_merge_into_runs_is_greedy_contiguous() -> None:
    assert merge_into_runs([10, 10, 10, 10], total_tokens=80, num_mini_batches=4) == [
        (0, 1),
        (2, 3),
    ]
    assert merge_into_runs([0, 30, 0, 5], total_tokens=80, num_mini_batches=4) == [(0, 1, 2), (3,)]
    # an over-full mini-batch is a run of its own; empty neighbours join the open run
    assert merge_into_runs([0, 0, 50, 0], total_tokens=80, num_mini_batches=4) == [(0, 1, 2, 3)]
    assert merge_into_runs([5, 50, 0], total_tokens=60, num_mini_batches=3) == [(0,), (1, 2)]
    assert merge_into_runs([0, 0], total_tokens=10, num_mini_batches=2) == [(0, 1)]


# ----------------------------------------------------------------------------- fillers


def test_fewer_kept_than_ranks_uses_shortest_zero_adv_of_the_mini_batch() -> None:
    seq_tokens = [40, 30, 20, 25, 90, 5, 80, 70]
    advantages = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    inputs = make_inputs(
        seq_tokens, advantages, ppo_mini_batches=2, dp_size=3, mode="match_loss_curve"
    )
    plan = plan_step(inputs)
    step0 = plan.optimizer_steps[0]
    fillers = [
        mb.seq_indices
        for rank in step0.ranks
        for mb in rank.micro_batches
        if mb.loss_weights == (0.0,)
    ]
    assert fillers == [(2,), (2,)]  # 20 tokens: shortest zero-adv of mini-batch 0 (not seq 5)
    assert plan.metrics["planner/filler_seqs"] == 2
    assert any("ranks 1, 2 padded with 2 fillers" in reason for reason in plan.reasons)
    assert_invariants(inputs, plan)


def test_filler_falls_back_to_batch_then_to_shortest_kept() -> None:
    inputs = make_inputs(
        [40, 30, 20, 25],
        [1.0, 2.0, 0.0, 0.0],
        ppo_mini_batches=2,
        dp_size=3,
        mode="match_loss_curve",
    )
    plan = plan_step(inputs)
    assert plan.optimizer_steps[1].is_ghost
    fillers = {
        mb.seq_indices
        for rank in plan.optimizer_steps[0].ranks
        for mb in rank.micro_batches
        if mb.loss_weights == (0.0,)
    }
    assert fillers == {(2,)}  # mini-batch 0 has no zero-adv seq: shortest of the batch
    assert_invariants(inputs, plan)

    all_kept = make_inputs([40, 30], [1.0, 2.0], dp_size=3, mode="match_loss_curve")
    plan = plan_step(all_kept)
    weights = [
        mb.loss_weights for rank in plan.optimizer_steps[0].ranks for mb in rank.micro_batches
    ]
    filler_mbs = [
        mb
        for rank in plan.optimizer_steps[0].ranks
        for mb in rank.micro_batches
        if mb.loss_weights == (0.0,)
    ]
    assert weights.count((0.0,)) == 1 and filler_mbs[0].seq_indices == (1,)
    assert_invariants(all_kept, plan)


def test_ranks_split_micro_batches_before_padding_with_fillers() -> None:
    # LPT on 2 ranks: {60, 30, 20} needs two micro-batches of budget 100, {50, 40, 10} fits one,
    # so the second rank splits its micro-batch instead of running a filler
    seq_tokens = [60, 50, 40, 30, 20, 10]
    inputs = make_inputs(
        seq_tokens,
        [1.0] * 6,
        dp_size=2,
        micro_batch_tokens=100,
        mode="match_loss_curve",
        attention_cost_coef=0.0,
    )
    plan = plan_step(inputs)
    step = plan.optimizer_steps[0]
    assert plan.num_filler_seqs == 0
    assert trained_by_rank(step) == [[0, 3, 4], [1, 2, 5]]
    assert [len(mb.seq_indices) for mb in step.ranks[1].micro_batches] == [1, 2]
    assert_invariants(inputs, plan)


def test_interleaved_pipeline_runs_a_multiple_of_pp_micro_batches() -> None:
    # one micro-batch of budget 100 would hold all three; the interleaved schedule over pp=4
    # runs groups of four: split first (no extra compute), then one filler at loss weight 0
    seq_tokens = [40, 30, 20]
    inputs = make_inputs(
        seq_tokens, [1.0, -1.0, 0.5], micro_batch_tokens=100, mode="off", micro_batch_multiple=4
    )
    plan = plan_step(inputs)
    [rank] = plan.optimizer_steps[0].ranks
    assert len(rank.micro_batches) == 4
    assert sorted(len(mb.seq_indices) for mb in rank.micro_batches) == [1, 1, 1, 1]
    assert plan.num_filler_seqs == 1
    assert trained_by_rank(plan.optimizer_steps[0]) == [[0, 1, 2]]  # each trained once
    assert_invariants(inputs, plan)
    plain = plan_step(make_inputs(seq_tokens, [1.0, -1.0, 0.5], micro_batch_tokens=100, mode="off"))
    assert len(plain.optimizer_steps[0].ranks[0].micro_batches) == 1


def test_forward_passes_run_a_multiple_of_pp_micro_batches() -> None:
    from megarl.planner.micro_batches import plan_forward_micro_batches

    tokens = [40, 30, 20, 10]
    assert plan_forward_micro_batches([0, 1, 2, 3], tokens, 100) == ((0, 1, 2, 3),)
    two = plan_forward_micro_batches([0, 1, 2, 3], tokens, 100, multiple=2)
    assert len(two) == 2 and sorted(i for mb in two for i in mb) == [0, 1, 2, 3]
    five = plan_forward_micro_batches([0, 1, 2], tokens, 100, multiple=4)
    assert len(five) == 4 and {i for mb in five for i in mb} == {0, 1, 2}  # one run twice
    assert plan_forward_micro_batches([], tokens, 100, multiple=4) == ()


def test_micro_batch_multiple_must_be_a_positive_int() -> None:
    with pytest.raises(PlannerError, match="micro_batch_multiple"):
        make_inputs([10, 10], [1.0, -1.0], micro_batch_multiple=0)


def test_over_long_sequence_gets_its_own_micro_batch() -> None:
    inputs = make_inputs([500, 10, 10, 10], [1.0] * 4, micro_batch_tokens=100, mode="off")
    plan = plan_step(inputs)
    batches = {mb.seq_indices for mb in plan.optimizer_steps[0].ranks[0].micro_batches}
    assert batches == {(0,), (1, 2, 3)}
    assert_invariants(inputs, plan)


def test_plan_is_deterministic_and_shares_rank_plans_across_epochs() -> None:
    inputs = lognormal_inputs(512, dp_size=8, seed=1)
    inputs = PlannerInputs(**{**vars(inputs), "ppo_epochs": 2, "ppo_mini_batches": 4})
    first, second = plan_step(inputs), plan_step(inputs)
    assert first == second
    assert first.optimizer_steps[0].ranks is first.optimizer_steps[4].ranks
    assert_invariants(inputs, first)


# ----------------------------------------------------------------------------- balance


@pytest.mark.parametrize("seed", range(4))
def test_dp_imbalance_bound_on_lognormal_lengths(seed: int) -> None:
    inputs = lognormal_inputs(4096, dp_size=32, seed=seed)
    plan = plan_step(inputs)
    assert plan.dp_imbalance <= 1.02
    assert_invariants(inputs, plan)


def test_balanced_partition_beats_a_contiguous_split() -> None:
    rng = np.random.default_rng(7)
    costs = sequence_costs(rng.lognormal(6.5, 0.8, 2048).astype(int) + 1, 1 / 24576)
    parts = balanced_partition(costs, 64)
    loads = np.array([costs[part].sum() for part in parts])
    naive = np.array([chunk.sum() for chunk in np.array_split(costs, 64)])
    assert sorted(np.concatenate(parts).tolist()) == list(range(2048))
    assert loads.max() / loads.mean() <= 1.02
    assert naive.max() / naive.mean() >= 1.2


def test_balanced_partition_edge_cases() -> None:
    parts = balanced_partition(np.array([5.0, 1.0]), 4)
    assert [part.tolist() for part in parts] == [[0], [1], [], []]
    assert [p.tolist() for p in balanced_partition(np.array([]), 2)] == [[], []]
    with pytest.raises(ValueError, match="num_parts"):
        balanced_partition(np.array([1.0]), 0)


def test_first_fit_decreasing_and_split() -> None:
    assert first_fit_decreasing([60, 50, 40, 150, 10], 100) == [[3], [0, 2], [1, 4]]
    first, second = split_in_two([3, 4, 5], [0, 0, 0, 9, 8, 2])
    assert (first, second) == ([3], [4, 5])
    with pytest.raises(ValueError):
        split_in_two([1], [5, 5])


def test_step_plan_rejects_unequal_micro_batch_counts() -> None:
    micro_batch = MicroBatch(seq_indices=(0,), loss_weights=(1.0,), num_tokens=5)
    with pytest.raises(ValueError, match="unequal micro-batch counts"):
        OptimizerStepPlan(
            epoch=0,
            mini_batch=0,
            source_mini_batches=(0,),
            normaliser=1.0,
            is_ghost=False,
            ranks=(RankPlan((micro_batch,)), RankPlan((micro_batch, micro_batch))),
        )
    with pytest.raises(ValueError, match="loss_weights"):
        MicroBatch(seq_indices=(0,), loss_weights=(0.5,), num_tokens=5)


# ----------------------------------------------------------------------------- properties


@st.composite
def planner_inputs(draw: st.DrawFn) -> PlannerInputs:
    num_mini_batches = draw(st.integers(1, 4))
    group_size = draw(st.integers(1, 4))
    groups_per_mini_batch = draw(st.integers(1, 4))
    num_sequences = num_mini_batches * group_size * groups_per_mini_batch
    num_groups = num_sequences // group_size
    seq_tokens = draw(st.lists(st.integers(1, 300), min_size=num_sequences, max_size=num_sequences))
    response_tokens = [draw(st.integers(0, t)) for t in seq_tokens]
    group_all_equal = draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    advantages = [
        0.0 if group_all_equal[i // group_size] else draw(st.sampled_from([-1.0, 0.0, 0.5, 2.0]))
        for i in range(num_sequences)
    ]
    mode = draw(st.sampled_from(["off", "match_loss_curve", "fast"]))
    approx = draw(st.booleans())
    return PlannerInputs(
        seq_tokens=seq_tokens,
        response_tokens=response_tokens,
        advantages=advantages,
        group_ids=[i // group_size for i in range(num_sequences)],
        loss_agg=draw(st.sampled_from(LOSS_AGG_MODES)),
        loss_scale_factor=draw(st.sampled_from([1.0, 16.0, 0.5])),
        loss_terms=LossTerms(kl_coef=0.05 if approx else 0.0),
        allow_approx=approx,
        dp_size=draw(st.integers(1, 6)),
        ppo_mini_batches=num_mini_batches,
        ppo_epochs=draw(st.integers(1, 2)),
        micro_batch_tokens=draw(st.integers(50, 600)),
        mode=mode,
        attention_cost_coef=draw(st.sampled_from([0.0, 1 / 4096])),
    )


@settings(max_examples=200, deadline=None)
@given(planner_inputs())
def test_invariants_hold_on_random_batches(inputs: PlannerInputs) -> None:
    plan = plan_step(inputs)
    assert_invariants(inputs, plan)
    assert plan_step(inputs) == plan
    if inputs.mode == "fast" and inputs.ppo_mini_batches == 1:  # fast is exact at M == 1
        match = plan_step(PlannerInputs(**{**vars(inputs), "mode": "match_loss_curve"}))
        assert plan.optimizer_steps == match.optimizer_steps


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 10_000), min_size=1, max_size=200),
    num_parts=st.integers(1, 16),
)
def test_partition_covers_every_item_once_and_never_worsens_lpt_bound(
    costs: list[int], num_parts: int
) -> None:
    array = np.array(costs, dtype=np.float64)
    parts = balanced_partition(array, num_parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(costs)))
    loads = np.array([array[part].sum() for part in parts])
    # Graham's LPT bound: max load <= mean load + largest item
    assert loads.max() <= array.sum() / num_parts + array.max() + 1e-6


# ----------------------------------------------------------------------------- prune setting


@pytest.mark.parametrize(
    ("setting", "kl", "entropy", "mode"),
    [
        ("auto", 0.0, 0.0, "match_loss_curve"),
        ("auto", 0.01, 0.0, "off"),
        ("auto", 0.0, 0.001, "off"),
        ("fast", 0.0, 0.0, "fast"),
        ("off", 0.0, 0.0, "off"),
    ],
)
def test_auto_prunes_only_when_exact(setting, kl, entropy, mode):
    from megarl.planner.pruning import resolve_prune_mode

    terms = LossTerms(kl_coef=kl, entropy_coef=entropy)
    resolved, reason = resolve_prune_mode(setting, terms)
    assert resolved == mode
    assert reason
    # whatever auto picks passes the start-up exactness check without allow_approx
    check_pruning_config(resolved, terms, allow_approx=False)


def test_unknown_prune_setting_is_one_clear_error():
    from megarl.planner.pruning import resolve_prune_mode

    with pytest.raises(PlannerError, match="planner.prune_zero_adv must be one of"):
        resolve_prune_mode("sometimes", LossTerms())


# ----------------------------------------------------------------------------- critic (gae)


def test_auto_never_prunes_for_a_critic_and_says_why():
    from megarl.planner.pruning import resolve_prune_mode

    resolved, reason = resolve_prune_mode("auto", LossTerms(adv_estimator="gae"))
    assert resolved == "off"
    assert "algo.adv_estimator=gae" in reason and "critic" in reason
    # the outcome estimators still prune when it is exact
    assert resolve_prune_mode("auto", LossTerms(adv_estimator="rloo"))[0] == "match_loss_curve"


@pytest.mark.parametrize("mode", ["match_loss_curve", "fast"])
@pytest.mark.parametrize("allow_approx", [False, True])
def test_named_pruning_modes_are_refused_for_a_critic(mode: str, allow_approx: bool):
    """Even where pruning would be exact for GRPO (no KL, no entropy), and even with
    allow_approx: a critic's value loss trains on every sequence."""
    critic = LossTerms(adv_estimator="gae")
    with pytest.raises(PlannerError, match="algo.adv_estimator=gae") as excinfo:
        check_pruning_config(mode, critic, allow_approx=allow_approx)
    assert "planner.prune_zero_adv" in str(excinfo.value)
    inputs = make_inputs([10] * 4, [0.0, 0.0, 1.0, -1.0], mode=mode, loss_terms=critic)
    with pytest.raises(PlannerError, match="cannot prune"):
        plan_step(inputs)


def test_a_critics_plan_trains_every_sequence_and_its_summary_says_why():
    """Sequences whose per-sequence advantage summary is 0 are trained all the same."""
    inputs = make_inputs(
        [10] * 8,
        [0.0] * 4 + [0.5, -0.5, 0.0, 1.0],
        loss_terms=LossTerms(adv_estimator="gae"),
        ppo_mini_batches=2,
    )
    plan = plan_step(inputs)
    assert plan.num_kept_sequences == 8
    assert plan.num_ghost_steps == 0
    assert sorted(i for s in plan.optimizer_steps for i in trained_by_rank(s)[0]) == list(range(8))
    assert "no pruning: algo.adv_estimator=gae" in plan.summary()
    assert "algo.adv_estimator=gae" in plan.reasons[0]
    # the same inputs under GRPO keep the summary free of it
    assert "no pruning" not in plan_step(make_inputs([10] * 8, [1.0] * 8)).summary()


# ----------------------------------------------------------------------------- router aux loss


def test_auto_never_prunes_with_a_router_load_balancing_loss_and_says_why():
    from megarl.planner.pruning import resolve_prune_mode

    router_loss = LossTerms(moe_aux_loss_coef=1e-3)
    resolved, reason = resolve_prune_mode("auto", router_loss)
    assert resolved == "off"
    assert "actor.moe_aux_loss_coef=0.001" in reason and "routed token" in reason
    # a zero coefficient leaves the exact rule as it was
    no_router_loss = LossTerms(moe_aux_loss_coef=0.0)
    assert resolve_prune_mode("auto", no_router_loss)[0] == "match_loss_curve"
    check_pruning_config(resolved, router_loss, allow_approx=False)


@pytest.mark.parametrize("mode", ["match_loss_curve", "fast"])
@pytest.mark.parametrize("allow_approx", [False, True])
def test_named_pruning_modes_are_refused_with_a_router_loss(mode: str, allow_approx: bool):
    """Even with no KL/entropy term and even with allow_approx: the load-balancing loss is a
    function of a micro-batch's routed tokens, not a sum of terms that vanish at advantage 0."""
    router_loss = LossTerms(moe_aux_loss_coef=0.01)
    with pytest.raises(PlannerError, match="actor.moe_aux_loss_coef=0.01") as excinfo:
        check_pruning_config(mode, router_loss, allow_approx=allow_approx)
    assert f"planner.prune_zero_adv={mode} cannot prune" in str(excinfo.value)
    assert "\n" not in str(excinfo.value)
    inputs = make_inputs([10] * 4, [0.0, 0.0, 1.0, -1.0], mode=mode, loss_terms=router_loss)
    with pytest.raises(PlannerError, match="cannot prune"):
        plan_step(inputs)
    # the same forced mode prunes without the coefficient
    plan_step(make_inputs([10] * 4, [0.0, 0.0, 1.0, -1.0], mode=mode))


def test_a_router_loss_plan_trains_every_sequence_and_its_summary_says_why():
    advantages = [0.0] * 4 + [0.5, -0.5, 0.0, 0.0]
    inputs = make_inputs(
        [10] * 8, advantages, loss_terms=LossTerms(moe_aux_loss_coef=0.01), dp_size=2
    )
    plan = plan_step(inputs)
    assert_invariants(inputs, plan)
    assert plan.num_kept_sequences == 8 and plan.num_ghost_steps == 0
    trained = sorted(i for s in plan.optimizer_steps for r in trained_by_rank(s) for i in r)
    assert trained == list(range(8))
    assert "no pruning: actor.moe_aux_loss_coef=0.01" in plan.summary()
    assert "actor.moe_aux_loss_coef=0.01" in plan.reasons[0]
    unforced = plan_step(make_inputs([10] * 8, advantages, dp_size=2, mode="match_loss_curve"))
    assert unforced.num_kept_sequences == 2 and "no pruning" not in unforced.summary()


def test_a_critic_refusal_is_named_first():
    from megarl.planner.pruning import pruning_refusal

    both = pruning_refusal(LossTerms(adv_estimator="gae", moe_aux_loss_coef=0.01))
    assert both is not None and "algo.adv_estimator=gae" in both
    assert pruning_refusal(LossTerms(adv_estimator="grpo", moe_aux_loss_coef=0.0)) is None


def test_echo_turns_pruning_off_and_every_reason_names_it():
    """ECHO trains a zero-advantage agent trajectory's observation tokens: auto does not
    prune, a named mode is refused (allow_approx too), and the plan says why."""
    from megarl.planner.pruning import resolve_prune_mode

    echo = LossTerms(echo_coef=0.1)
    resolved, reason = resolve_prune_mode("auto", echo)
    assert resolved == "off" and "actor.echo_coef=0.1" in reason and "observation" in reason
    assert resolve_prune_mode("auto", LossTerms(echo_coef=0.0))[0] == "match_loss_curve"
    for allow_approx in (False, True):
        with pytest.raises(PlannerError, match="actor.echo_coef=0.1 trains the observation"):
            check_pruning_config("fast", echo, allow_approx=allow_approx)
    advantages = [0.0] * 4 + [0.5, -0.5, 0.0, 0.0]
    plan = plan_step(make_inputs([10] * 8, advantages, loss_terms=echo, dp_size=2))
    assert plan.num_kept_sequences == 8
    assert "actor.echo_coef=0.1" in plan.reasons[0]
    assert "no pruning: actor.echo_coef=0.1" in plan.summary()

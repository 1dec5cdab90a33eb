"""Outcome advantage estimators against hand-computed / formula values and exact-zero guarantees."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_relative_advantages,
    zero_advantage_mask,
)


def _rewards(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def test_single_group_matches_hand_computed_std_normalised_values() -> None:
    # mean 0.75, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    adv_B = group_relative_advantages(_rewards(1, 0, 1, 1), _ids(0, 0, 0, 0), eps=0.0)
    torch.testing.assert_close(adv_B, _rewards(0.5, -1.5, 0.5, 0.5))


def test_eps_is_added_to_the_std() -> None:
    adv_B = group_relative_advantages(_rewards(1, 0, 1, 1), _ids(0, 0, 0, 0), eps=0.5)
    torch.testing.assert_close(adv_B, _rewards(0.25, -0.75, 0.25, 0.25))


def test_no_std_is_mean_centred_only() -> None:
    adv_B = group_relative_advantages(_rewards(1, 0, 1, 1), _ids(0, 0, 0, 0), norm_by_std=False)
    torch.testing.assert_close(adv_B, _rewards(0.25, -0.75, 0.25, 0.25))


def test_non_contiguous_unsorted_group_ids() -> None:
    # group 42: rewards [2, 0] -> mean 1, unbiased std sqrt(2) -> +-1/sqrt(2)
    # group -7: rewards [3, 6, 0] -> mean 3, unbiased std 3 -> [0, 1, -1]
    rewards_B = _rewards(2, 3, 6, 0, 0)
    group_ids_B = _ids(42, -7, -7, 42, -7)
    adv_B = group_relative_advantages(rewards_B, group_ids_B, eps=0.0)
    half_sqrt2 = 2**-0.5
    torch.testing.assert_close(adv_B, _rewards(half_sqrt2, 0.0, 1.0, -half_sqrt2, -1.0))


def test_matches_per_group_loop_reference_on_random_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards_B = torch.rand(60, generator=gen)
    group_ids_B = torch.randint(0, 1000, (12,), generator=gen).repeat_interleave(5)
    group_ids_B = group_ids_B[torch.randperm(60, generator=gen)]

    adv_B = group_relative_advantages(rewards_B, group_ids_B, eps=1e-6)

    expected_B = torch.empty_like(rewards_B)
    for group_id in group_ids_B.unique():
        in_group_B = group_ids_B == group_id
        group_rewards = rewards_B[in_group_B]
        expected_B[in_group_B] = (group_rewards - group_rewards.mean()) / (
            group_rewards.std() + 1e-6
        )
    torch.testing.assert_close(adv_B, expected_B)


@pytest.mark.parametrize(
    ("value", "size"),
    [(0.1, 3), (0.1, 7), (0.9, 3), (0.3, 6), (0.7, 7), (1.0, 4), (0.0, 8), (-2.5, 5)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_all_equal_group_gets_exactly_zero(
    value: float, size: int, dtype: torch.dtype, norm_by_std: bool
) -> None:
    rewards_B = torch.full((size,), value, dtype=dtype)
    adv_B = group_relative_advantages(rewards_B, torch.zeros(size, dtype=torch.long), norm_by_std)
    assert torch.equal(adv_B, torch.zeros(size, dtype=dtype))
    assert zero_advantage_mask(adv_B).all()


@pytest.mark.parametrize(
    ("value", "size", "dtype"),
    [
        (0.1, 7, torch.float32),
        (0.9, 3, torch.float32),
        (0.1, 3, torch.float64),
        (0.7, 7, torch.float64),
    ],
)
def test_exact_zero_case_is_not_trivially_satisfied_by_naive_mean(
    value: float, size: int, dtype: torch.dtype
) -> None:
    """Guards the test above: naive centring really leaves residue for these inputs."""
    rewards_B = torch.full((size,), value, dtype=dtype)
    assert (rewards_B - rewards_B.mean()).abs().max() > 0


def test_constant_group_is_zero_while_other_groups_are_not() -> None:
    rewards_B = _rewards(0.1, 1.0, 0.1, 0.0, 0.1)
    group_ids_B = _ids(5, 9, 5, 9, 5)
    adv_B = group_relative_advantages(rewards_B, group_ids_B, eps=0.0)
    half_sqrt2 = 2**-0.5
    assert torch.equal(adv_B[[0, 2, 4]], torch.zeros(3))
    torch.testing.assert_close(adv_B[[1, 3]], _rewards(half_sqrt2, -half_sqrt2))
    assert zero_advantage_mask(adv_B).tolist() == [True, False, True, False, True]


def test_singleton_group_gets_zero_not_nan() -> None:
    adv_B = group_relative_advantages(_rewards(0.7, 1, 0), _ids(3, 8, 8))
    assert adv_B[0].item() == 0.0
    assert torch.isfinite(adv_B).all()


def test_integer_rewards_give_float_advantages() -> None:
    adv_B = group_relative_advantages(torch.tensor([1, 0]), _ids(0, 0), eps=0.0)
    assert adv_B.dtype == torch.get_default_dtype()
    torch.testing.assert_close(adv_B, _rewards(2**-0.5, -(2**-0.5)))


def test_keeps_float_dtype() -> None:
    rewards_B = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert group_relative_advantages(rewards_B, _ids(0, 0)).dtype == torch.float64


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(ValueError, match="same length"):
        group_relative_advantages(_rewards(1, 0, 1), _ids(0, 0))


def test_zero_advantage_mask_is_exact_not_approximate() -> None:
    adv_B = torch.tensor([0.0, -0.0, 1e-9, -1e-30, 0.5])
    assert zero_advantage_mask(adv_B).tolist() == [True, True, False, False, False]


def test_registry_estimators_differ_by_std_normalisation() -> None:
    rewards_B, group_ids_B = _rewards(1, 0, 1, 1), _ids(0, 0, 0, 0)
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo",
        "grpo_no_std",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "maxrl",
        "gdpo",
    }
    torch.testing.assert_close(
        get_advantage_estimator("grpo")(rewards_B, group_ids_B),
        _rewards(0.5, -1.5, 0.5, 0.5),
        atol=1e-5,
        rtol=0,
    )
    torch.testing.assert_close(
        get_advantage_estimator("grpo_no_std")(rewards_B, group_ids_B),
        _rewards(0.25, -0.75, 0.25, 0.25),
    )


def test_unknown_estimator_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="grpo, grpo_no_std") as excinfo:
        get_advantage_estimator("gae_typo")
    assert "gae_typo" in str(excinfo.value)


# --- verl's other outcome estimators --------------------------------------------------------
# Each reference below is computed straight from the paper's formula with explicit loops, not
# from the vectorised code under test.

WHITEN_EPS = 1e-8  # verl's masked_whiten: (x - mean) * rsqrt(var_unbiased + 1e-8)


def _loo_reference(rewards: list[float], groups: list[int]) -> list[float]:
    # RLOO, Ahmadian et al. 2024 "Back to Basics", eq. (6) of sec. 3.2:
    # A_i = R(y_i) - 1/(k-1) * sum_{j != i} R(y_j) over the k samples of the same prompt.
    out = []
    for i, (r_i, g_i) in enumerate(zip(rewards, groups, strict=True)):
        others = [
            r for j, (r, g) in enumerate(zip(rewards, groups, strict=True)) if g == g_i and j != i
        ]
        out.append(r_i - sum(others) / len(others))
    return out


def _batch_whiten_reference(values: list[float]) -> list[float]:
    # REINFORCE++, Hu 2025, sec. 3 "global advantage normalization":
    # A_norm = (A - mean_batch(A)) / std_batch(A), with verl's unbiased var and 1e-8 under sqrt.
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / (var + WHITEN_EPS) ** 0.5 for v in values]


def _group_centred_reference(rewards: list[float], groups: list[int]) -> list[float]:
    # Dr.GRPO, Liu et al. 2025 "Understanding R1-Zero-Like Training", the advantage of eq. (3):
    # A_i = R_i - mean({R_1..R_G}), no division by std.
    out = []
    for r_i, g_i in zip(rewards, groups, strict=True):
        members = [r for r, g in zip(rewards, groups, strict=True) if g == g_i]
        out.append(r_i - sum(members) / len(members))
    return out


MIXED_REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.25]
MIXED_GROUPS = [3, 3, 3, 3, 8, 8, 8, 8]


def test_rloo_matches_leave_one_out_formula() -> None:
    adv_B = get_advantage_estimator("rloo")(_rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS))
    expected = _loo_reference(MIXED_REWARDS, MIXED_GROUPS)
    # group 3: 1 - (0 + 0 + 1) / 3 = 2/3 ; 0 - 2/3 = -2/3
    assert expected[:4] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    torch.testing.assert_close(adv_B, _rewards(*expected))


def test_rloo_is_grpo_no_std_scaled_by_n_over_n_minus_1() -> None:
    rewards_B, group_ids_B = _rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS)
    torch.testing.assert_close(
        get_advantage_estimator("rloo")(rewards_B, group_ids_B),
        get_advantage_estimator("grpo_no_std")(rewards_B, group_ids_B) * 4 / 3,
    )


def test_grpo_no_std_matches_dr_grpo_formula() -> None:
    adv_B = get_advantage_estimator("grpo_no_std")(_rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS))
    torch.testing.assert_close(
        adv_B, _rewards(*_group_centred_reference(MIXED_REWARDS, MIXED_GROUPS))
    )


def test_reinforce_plus_plus_whitens_rewards_over_the_batch() -> None:
    adv_B = get_advantage_estimator("reinforce_plus_plus")(
        _rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS)
    )
    expected = _batch_whiten_reference(MIXED_REWARDS)
    torch.testing.assert_close(adv_B, _rewards(*expected))
    # batch mean 0.46875: a reward of 1 scores above it whatever its group did
    assert adv_B[0] > 0 and adv_B[4] > 0 and adv_B[1] < 0
    assert abs(adv_B.double().mean().item()) < 1e-6
    assert adv_B.double().std().item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_plus_plus_gives_a_constant_group_a_signal() -> None:
    """No group baseline: an all-correct prompt is still scored against the other prompts."""
    adv_B = get_advantage_estimator("reinforce_plus_plus")(
        _rewards(1, 1, 1, 0, 1, 0), _ids(0, 0, 0, 1, 1, 1)
    )
    assert torch.equal(adv_B[0], adv_B[1]) and torch.equal(adv_B[1], adv_B[2])
    assert adv_B[0].item() > 0
    torch.testing.assert_close(adv_B, _rewards(*_batch_whiten_reference([1, 1, 1, 0, 1, 0])))


def test_reinforce_plus_plus_baseline_matches_verl_formula() -> None:
    adv_B = get_advantage_estimator("reinforce_plus_plus_baseline")(
        _rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS)
    )
    # verl: group mean subtracted, then masked_whiten over the batch (equal weights here)
    expected = _batch_whiten_reference(_group_centred_reference(MIXED_REWARDS, MIXED_GROUPS))
    torch.testing.assert_close(adv_B, _rewards(*expected))
    # it is Dr.GRPO's advantage divided by one batch-wide std, so ratios within a batch hold
    centred_B = get_advantage_estimator("grpo_no_std")(
        _rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS)
    )
    torch.testing.assert_close(adv_B / adv_B[0], centred_B / centred_B[0])


@pytest.mark.parametrize(
    "name", ["grpo", "grpo_no_std", "rloo", "reinforce_plus_plus_baseline", "maxrl", "gdpo"]
)
@pytest.mark.parametrize(("value", "size"), [(0.1, 3), (0.1, 7), (0.9, 3), (0.7, 7), (-2.5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_baselined_estimators_give_constant_groups_exactly_zero(
    name: str, value: float, size: int, dtype: torch.dtype
) -> None:
    """A constant group next to a non-constant one: the latter keeps a signal, the former none."""
    rewards_B = torch.cat(
        [torch.full((size,), value, dtype=dtype), torch.tensor([0.0, 1.0, 0.5], dtype=dtype)]
    )
    group_ids_B = torch.cat([torch.zeros(size, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    adv_B = get_advantage_estimator(name)(rewards_B, group_ids_B)
    assert adv_B.dtype == dtype
    assert torch.equal(adv_B[:size], torch.zeros(size, dtype=dtype))
    assert adv_B[size].item() < 0 < adv_B[size + 1].item()


CONSTANT_BATCHES = [(0.1, 3, torch.float64), (0.7, 7, torch.float64), (0.9, 3, torch.float32)]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize(("value", "size", "dtype"), CONSTANT_BATCHES)
def test_every_estimator_gives_a_constant_batch_exactly_zero(
    name: str, value: float, size: int, dtype: torch.dtype
) -> None:
    rewards_B = torch.full((size,), value, dtype=dtype)
    adv_B = get_advantage_estimator(name)(rewards_B, torch.arange(size) // 2)
    assert torch.equal(adv_B, torch.zeros(size, dtype=dtype))


def test_constant_batch_case_is_not_trivially_satisfied_by_naive_whitening() -> None:
    """Guards the test above: plain whitening turns the float64 mean's residue into ~1e-13,
    which the planner would not prune (float32 rewards have an exact float64 mean)."""
    x_B = torch.full((3,), 0.1, dtype=torch.float64)
    naive_B = (x_B - x_B.mean()) * torch.rsqrt(x_B.var() + WHITEN_EPS)
    assert naive_B.abs().max() > 0


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "maxrl", "gdpo"])
def test_singleton_group_gets_zero_for_group_baselines(name: str) -> None:
    adv_B = get_advantage_estimator(name)(_rewards(0.7, 1, 0), _ids(3, 8, 8))
    assert adv_B[0].item() == 0.0
    assert adv_B[1].item() > 0 > adv_B[2].item()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_handles_empty_and_rejects_mismatched_batches(name: str) -> None:
    assert get_advantage_estimator(name)(_rewards(), _ids()).shape == (0,)
    with pytest.raises(ValueError, match="same length"):
        get_advantage_estimator(name)(_rewards(1, 0, 1), _ids(0, 0))


def test_whitened_zero_by_coincidence_is_pruned_and_contributes_nothing() -> None:
    """reinforce_plus_plus puts the batch's middle reward at exactly 0.0 (a float coincidence,
    no structural zero); pruning it is still exact: its PPO loss and gradient are exactly 0."""
    from megarl.algo.losses import policy_loss

    adv_B = get_advantage_estimator("reinforce_plus_plus")(_rewards(0, 1, 2), _ids(0, 1, 2))
    assert zero_advantage_mask(adv_B).tolist() == [False, True, False]

    gen = torch.Generator().manual_seed(1)
    logp_BT = (-torch.rand(3, 4, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    # small enough that no ratio leaves [0.8, 1.2]: every kept token has a gradient
    old_logp_BT = logp_BT.detach() + 0.05 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    mask_BT = torch.ones(3, 4, dtype=torch.float64)
    full = policy_loss(logp_BT, old_logp_BT, adv_B.double(), mask_BT, denom=12.0).loss
    (grad_BT,) = torch.autograd.grad(full, logp_BT)
    assert torch.equal(grad_BT[1], torch.zeros(4, dtype=torch.float64))
    assert grad_BT[0].abs().min() > 0 and grad_BT[2].abs().min() > 0

    kept = [0, 2]  # the planner trains the rest under the unpruned normaliser
    pruned = policy_loss(
        logp_BT[kept], old_logp_BT[kept], adv_B.double()[kept], mask_BT[kept], denom=12.0
    ).loss
    assert pruned.item() == pytest.approx(full.item(), rel=1e-15, abs=0)


def test_norm_adv_by_std_in_grpo_false_is_grpo_no_std() -> None:
    from megarl.config.algorithm import AlgoConfig

    assert AlgoConfig("grpo", norm_adv_by_std_in_grpo=True).estimator == "grpo"
    switched = AlgoConfig("grpo", norm_adv_by_std_in_grpo=False).estimator
    assert switched == "grpo_no_std"
    # verl reads the flag only in grpo
    assert AlgoConfig("rloo", norm_adv_by_std_in_grpo=False).estimator == "rloo"
    rewards_B, group_ids_B = _rewards(*MIXED_REWARDS), _ids(*MIXED_GROUPS)
    assert torch.equal(
        get_advantage_estimator(switched)(rewards_B, group_ids_B),
        group_relative_advantages(rewards_B, group_ids_B, norm_by_std=False),
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_config_accepts_every_registered_estimator(name: str) -> None:
    from megarl.config.schema import build_run_config

    assert build_run_config({"algo": {"adv_estimator": name}}).algo.adv_estimator == name


@pytest.mark.parametrize(
    ("algo", "needle"),
    [
        (
            {"adv_estimator": "ppo"},
            (
                "algo.adv_estimator='ppo': must be one of grpo, grpo_no_std, rloo, "
                "reinforce_plus_plus, reinforce_plus_plus_baseline, maxrl, gdpo, gae"
            ),
        ),
        ({"adv_estimator": "RLOO"}, "algo.adv_estimator='RLOO': must be one of"),
        (
            {"norm_adv_by_std_in_grpo": "no"},
            "algo.norm_adv_by_std_in_grpo='no': expected true or false",
        ),
        (
            {"norm_adv_by_std_in_grpo_typo": True},
            "unknown config key algo.norm_adv_by_std_in_grpo_typo",
        ),
    ],
)
def test_bad_algo_config_is_one_line_naming_the_key(algo: dict, needle: str) -> None:
    from megarl.config.schema import ConfigError, build_run_config

    with pytest.raises(ConfigError) as info:
        build_run_config({"algo": algo})
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


# --- MaxRL and GDPO against direct transcriptions of their papers' equations -----------------


def _random_groups(
    seed: int, groups: int = 9, size: int = 6
) -> tuple[torch.Tensor, torch.Generator]:
    """Shuffled group ids with arbitrary values: ``groups`` groups of ``size``."""
    gen = torch.Generator().manual_seed(seed)
    ids_B = torch.randint(0, 10_000, (groups,), generator=gen).repeat_interleave(size)
    return ids_B[torch.randperm(groups * size, generator=gen)], gen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maxrl_matches_the_papers_mean_normalised_advantage(seed: int) -> None:
    """arXiv:2602.02710: A_i = (r_i - mean_G r) / mean_G r, transcribed group by group (eps as
    SkyRL); 0/1 rewards as the paper trains with, plus a group with no success (mean 0)."""
    ids_B, gen = _random_groups(seed)
    rewards_B = (torch.rand(ids_B.numel(), generator=gen) < 0.4).double()
    rewards_B[ids_B == ids_B[0]] = 0.0  # a group with no success: no signal
    adv_B = get_advantage_estimator("maxrl")(rewards_B, ids_B)

    expected_B = torch.zeros_like(rewards_B)
    for group_id in ids_B.unique().tolist():
        members = (ids_B == group_id).nonzero().flatten().tolist()
        mean = sum(rewards_B[i].item() for i in members) / len(members)
        for i in members:
            expected_B[i] = 0.0 if mean <= 0 else (rewards_B[i].item() - mean) / (mean + 1e-6)
    torch.testing.assert_close(adv_B, expected_B)
    assert torch.equal(adv_B[ids_B == ids_B[0]], torch.zeros(6, dtype=torch.float64))
    assert (adv_B != 0).any()


def test_maxrl_weighs_a_rare_success_by_one_over_the_pass_rate() -> None:
    """One success in 4 (p = 1/4) gets (1 - p) / p = 3; one failure in 4 (p = 3/4) gets -1."""
    adv_B = get_advantage_estimator("maxrl")(
        torch.tensor([1.0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.float64), _ids(0, 0, 0, 0, 1, 1, 1, 1)
    )
    torch.testing.assert_close(
        adv_B,
        torch.tensor([3.0, -1, -1, -1, -1, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64),
        atol=1e-5,
        rtol=1e-5,
    )


def _gdpo_transcribed(rewards_BK: torch.Tensor, ids_B: torch.Tensor, weights: list[float]):
    """arXiv:2601.05242 as NeMo-RL's guide writes it: per reward, (r - group mean) / (group
    std + eps); the weighted sum; (A - batch mean) / (batch std + eps). Plain Python loops."""
    eps = 1e-6
    num, num_rewards = rewards_BK.shape
    summed = [0.0] * num
    for k in range(num_rewards):
        for group_id in ids_B.unique().tolist():
            members = (ids_B == group_id).nonzero().flatten().tolist()
            values = [rewards_BK[i, k].item() for i in members]
            mean = sum(values) / len(values)
            std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
            for i, v in zip(members, values, strict=True):
                summed[i] += weights[k] * (v - mean) / (std + eps)
    batch_mean = sum(summed) / num
    batch_std = (sum((a - batch_mean) ** 2 for a in summed) / (num - 1)) ** 0.5
    return torch.tensor([(a - batch_mean) / (batch_std + eps) for a in summed], dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 0.5, 0.25]])
def test_gdpo_matches_the_papers_equations_on_random_rewards(
    seed: int, weights: list[float]
) -> None:
    from megarl.algo.advantages import gdpo_advantages

    ids_B, gen = _random_groups(seed)
    rewards_BK = torch.stack(
        [
            (torch.rand(ids_B.numel(), generator=gen) < 0.5).double(),  # correctness
            torch.rand(ids_B.numel(), generator=gen, dtype=torch.float64),  # a graded score
            (torch.rand(ids_B.numel(), generator=gen) < 0.8).double(),  # format
        ],
        dim=1,
    )
    adv_B = gdpo_advantages(rewards_BK, ids_B, torch.tensor(weights, dtype=torch.float64))
    torch.testing.assert_close(adv_B, _gdpo_transcribed(rewards_BK, ids_B, weights))


def test_gdpo_separates_reward_combinations_grpo_collapses() -> None:
    """The paper's motivating case: (1, 0) and (0, 1) have the same total, so GRPO on the sum
    gives them one advantage; GDPO gives them different ones (reward 1 is rarer in the group)."""
    from megarl.algo.advantages import gdpo_advantages

    rewards_BK = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    ids_B = _ids(0, 0, 0, 0)
    grpo_B = get_advantage_estimator("grpo")(rewards_BK.sum(dim=1), ids_B)
    gdpo_B = gdpo_advantages(rewards_BK, ids_B)
    assert grpo_B[0] == grpo_B[1]
    assert gdpo_B[0] > gdpo_B[1] > gdpo_B[3]


def test_gdpo_keeps_constant_groups_exactly_zero_with_several_rewards() -> None:
    """Group 0's two rewards are each constant (0.1 and 0.7, whose float means leave residue):
    its advantage is exactly 0, so the planner prunes it; group 1 keeps a signal."""
    from megarl.algo.advantages import gdpo_advantages

    rewards_BK = torch.tensor(
        [[0.1, 0.7]] * 7 + [[1.0, 0.0], [0.0, 0.5], [1.0, 1.0]], dtype=torch.float64
    )
    ids_B = torch.tensor([0] * 7 + [1] * 3)
    adv_B = gdpo_advantages(rewards_BK, ids_B, torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert zero_advantage_mask(adv_B).tolist() == [True] * 7 + [False] * 3


def test_gdpo_refuses_a_weight_count_that_does_not_match_the_rewards() -> None:
    from megarl.algo.advantages import gdpo_advantages

    with pytest.raises(ValueError, match="2 entries"):
        gdpo_advantages(torch.zeros(4, 2), _ids(0, 0, 1, 1), torch.ones(3))

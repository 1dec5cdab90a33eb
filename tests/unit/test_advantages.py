"""Group-relative (GRPO) advantages against hand-computed values and exact-zero guarantees."""

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
    "value, size",
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
    "value, size, dtype",
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
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "grpo_no_std"}
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

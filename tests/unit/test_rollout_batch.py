"""RolloutBatch refuses per-position fields whose lengths disagree with its sequences: each
optional field is checked against the positions (input routing) or response tokens it covers."""

from __future__ import annotations

import pytest
import torch

from megarl.batch import RolloutBatch

# two sequences: 5 positions (prompt 2, response 3) and 4 positions (prompt 3, response 1)
TOKENS = (torch.arange(10, 15), torch.arange(20, 24))
PROMPT_LENS = (2, 3)


def _batch(**fields) -> RolloutBatch:
    return RolloutBatch(
        tokens=TOKENS,
        prompt_lens=PROMPT_LENS,
        group_ids=torch.tensor([0, 0]),
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        engine_logprobs=(torch.zeros(3), torch.zeros(1)),
        **fields,
    )


@pytest.mark.parametrize(
    ("field", "right", "wrong", "message"),
    [
        (
            "engine_input_routing",
            (5, 4),
            (5, 3),
            "engine input routing of [5, 3] positions, [5, 4]",
        ),
        ("engine_routing", (3, 1), (2, 1), "engine routing of [2, 1] tokens, [3, 1]"),
        ("behaviour_versions", (3, 1), (3, 2), "behaviour versions of [3, 2] tokens, [3, 1]"),
        ("response_masks", (3, 1), (4, 1), "response masks of [4, 1] tokens, [3, 1]"),
    ],
)
def test_a_per_position_field_of_the_wrong_length_is_refused(field, right, wrong, message):
    assert getattr(_batch(**{field: tuple(torch.zeros(n) for n in right)}), field) is not None
    with pytest.raises(ValueError) as refused:
        _batch(**{field: tuple(torch.zeros(n) for n in wrong)})
    assert str(refused.value) == message

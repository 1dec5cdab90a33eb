"""RolloutBatch refuses per-position fields whose lengths disagree with its sequences: each
optional field is checked against the positions (input routing) or response tokens it covers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.batches import random_batch

# two sequences: 5 positions (prompt 2, response 3) and 4 positions (prompt 3, response 1)
BATCH = random_batch([5, 4], [2, 3], vocab_size=32, advantages=torch.zeros(2), seed=0)


def _with(field: str, lengths: tuple[int, ...]):
    return dataclasses.replace(BATCH, **{field: tuple(torch.zeros(n) for n in lengths)})


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
    assert getattr(_with(field, right), field) is not None
    with pytest.raises(ValueError) as refused:
        _with(field, wrong)
    assert str(refused.value) == message

"""How the engines that own their decode loop batch a call, on plain token ids: each distinct
context is prefilled once and every request gets its row; left padding keeps real positions."""

from __future__ import annotations

import torch

from megarl.engines.base import Request
from megarl.engines.batching import DistinctContexts, left_pad


def test_requests_with_one_context_share_a_prefill_row():
    requests = [
        Request((5, 6), seed=1),
        Request((7,), seed=2),
        Request((5, 6), seed=3),  # a second sample of the first prompt
        Request((5,), seed=4, generated_ids=(6,)),  # the same context, resumed
        Request((5, 6), seed=5, generated_ids=(9,)),
    ]
    prefill = DistinctContexts.of(requests)
    assert prefill.contexts == ((5, 6), (7,), (5, 6, 9))
    assert prefill.rows == (0, 1, 0, 0, 2)
    assert prefill.shared
    assert not DistinctContexts.of(requests[:2]).shared


def test_left_padding_puts_the_last_token_in_the_last_column_with_unpadded_positions():
    batch = left_pad([(3, 4, 5), (8,)], pad_token_id=0, device=torch.device("cpu"))
    assert batch.input_ids_BT.tolist() == [[3, 4, 5], [0, 0, 8]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.position_ids_BT.tolist() == [[0, 1, 2], [1, 1, 0]]

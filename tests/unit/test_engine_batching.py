"""How the engines that own their decode loop batch a call, on plain token ids: each distinct
context is prefilled once and every request gets its row; left padding keeps real positions."""

from __future__ import annotations

import torch

from megarl.engines.base import Request, SamplingParams
from megarl.engines.batching import DistinctContexts, left_pad, shard_requests


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


PARAMS = SamplingParams(max_new_tokens=4)


def test_replicas_get_whole_contexts_and_balanced_work():
    """Eight requests: a group of four of one prompt, two pairs, and the pair's resumed
    request (another context). No context is split; the work (context + budget per request)
    ends as even as whole contexts allow; every request is generated once."""
    requests = [Request((5, 6, 7), seed=i) for i in range(4)]  # work 4 x 7 = 28
    requests += [Request((8,), seed=10), Request((8,), seed=11)]  # 2 x 5 = 10
    requests += [Request((9, 9), seed=12), Request((9, 9), seed=13)]  # 2 x 6 = 12
    requests += [Request((9,), seed=14, generated_ids=(9, 4))]  # context (9, 9, 4): 3 + 2 = 5
    shares = shard_requests(requests, PARAMS, 2)
    assert shares == ((0, 1, 2, 3), (4, 5, 6, 7, 8))
    assert sorted(i for share in shares for i in share) == list(range(len(requests)))
    for share in shares:
        contexts = {requests[i].context_ids for i in share}
        assert all(i in share for i, r in enumerate(requests) if r.context_ids in contexts)


def test_fewer_contexts_than_replicas_leave_a_replica_idle_and_one_share_is_the_call():
    requests = [Request((3, 4), seed=i) for i in range(3)]
    assert shard_requests(requests, PARAMS, 4) == ((0, 1, 2), (), (), ())
    assert shard_requests(requests, PARAMS, 1) == ((0, 1, 2),)
    assert shard_requests([], PARAMS, 2) == ((), ())


def test_equal_work_goes_in_request_order_to_the_lower_replica():
    """Ties are broken the same way on every rank: the first-named context to the first
    replica with the least work."""
    requests = [Request((i,), seed=i) for i in range(1, 5)]
    assert shard_requests(requests, PARAMS, 2) == ((0, 2), (1, 3))

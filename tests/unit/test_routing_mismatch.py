"""Engine vs trainer routing of mixture-of-experts models, on hand-made expert ids.

The definition: per (response token, layer) the two top-k expert *sets* are compared; the
metric is the fraction of pairs that differ, summed over ranks before dividing.
"""

from __future__ import annotations

import pytest
import torch

from megarl.algo.routing_mismatch import (
    MISMATCH_METRIC,
    MISMATCH_TOKENS_METRIC,
    RoutingMismatch,
    compare_routing,
    expert_id_dtype,
    expert_ids_from_routing_map,
    routing_mismatch_of_sequences,
)

# one sequence, 3 response tokens, 2 layers, top-2
ENGINE_TLK = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]])


def _compare(engine_TLK: torch.Tensor, trainer_TLK: torch.Tensor) -> RoutingMismatch:
    return routing_mismatch_of_sequences({0: trainer_TLK}, {0: engine_TLK}).counts()


def test_same_sets_in_another_order_are_equal() -> None:
    reordered = ENGINE_TLK.flip(-1)  # [[1, 0], [3, 2]], ...
    counts = _compare(ENGINE_TLK, reordered)
    assert counts == RoutingMismatch(pairs=6, mismatched_pairs=0, tokens=3, mismatched_tokens=0)
    assert counts.metrics() == {MISMATCH_METRIC: 0.0, MISMATCH_TOKENS_METRIC: 0.0}


def test_different_sets_count_per_pair_and_per_token() -> None:
    trainer = ENGINE_TLK.clone()
    trainer[0, 1] = torch.tensor([2, 1])  # token 0, layer 1: {2, 3} -> {1, 2}
    trainer[2, 0] = torch.tensor([0, 2])  # token 2, layer 0: {0, 3} -> {0, 2}
    trainer[2, 1] = torch.tensor([2, 3])  # token 2, layer 1 too: still one token
    counts = _compare(ENGINE_TLK, trainer)
    assert counts == RoutingMismatch(pairs=6, mismatched_pairs=3, tokens=3, mismatched_tokens=2)
    assert counts.metrics() == {MISMATCH_METRIC: 0.5, MISMATCH_TOKENS_METRIC: 2 / 3}


def test_a_tie_broken_the_other_way_is_a_mismatch() -> None:
    """Experts 1 and 2 tied for the second place: the engine took 1, the trainer 2. Each side
    reports what it computed with, so this is a real difference, not forgiven."""
    engine = torch.tensor([[[0, 1]]])
    trainer = torch.tensor([[[0, 2]]])
    assert _compare(engine, trainer).mismatched_pairs == 1


def test_padding_is_never_counted() -> None:
    """A padded batch: garbage in the masked slots (different sets there) changes nothing."""
    engine = torch.tensor([[[[0, 1]], [[2, 3]]], [[[0, 1]], [[9, 9]]]])  # [B=2, T=2, L=1, k=2]
    trainer = torch.tensor([[[[1, 0]], [[3, 2]]], [[[0, 1]], [[0, 0]]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    counts = compare_routing(engine, trainer, mask).counts()
    assert counts == RoutingMismatch(pairs=3, mismatched_pairs=0, tokens=3, mismatched_tokens=0)


def test_sequences_of_other_lengths_are_padded_and_masked() -> None:
    engine = {0: ENGINE_TLK, 1: ENGINE_TLK[:1], 5: ENGINE_TLK}
    trainer = {0: ENGINE_TLK, 1: torch.tensor([[[0, 1], [0, 1]]])}  # seq 1 layer 1 differs
    counts = routing_mismatch_of_sequences(trainer, engine).counts()  # seq 5: no trainer routing
    assert counts == RoutingMismatch(pairs=8, mismatched_pairs=1, tokens=4, mismatched_tokens=1)
    with pytest.raises(ValueError, match="sequence 0"):
        routing_mismatch_of_sequences({0: ENGINE_TLK[:2]}, engine)


def test_pipeline_stages_add_pairs_and_count_each_token_once() -> None:
    """Layers 0 and 1 on two pipeline stages. Token 0 differs in layer 1 only, token 2 in both
    layers: each stage compares its own layer, the flags are merged by logical or (what the
    rank loop's maximum over the pipeline group does), and one stage counts the tokens. The
    sum equals the comparison of both layers on one stage."""
    trainer = ENGINE_TLK.clone()
    trainer[0, 1] = torch.tensor([2, 1])
    trainer[2, 0] = torch.tensor([0, 2])
    trainer[2, 1] = torch.tensor([2, 3])
    stages = [
        routing_mismatch_of_sequences({0: trainer[:, [layer]]}, {0: ENGINE_TLK[:, [layer]]})
        for layer in (0, 1)
    ]
    assert [s.differs_T.tolist() for s in stages] == [[False, False, True], [True, False, True]]
    merged = torch.maximum(stages[0].differs_T, stages[1].differs_T)
    rows = [s.counts(merged, count_tokens=s is stages[-1]).to_row() for s in stages]
    summed = RoutingMismatch.from_row([a + b for a, b in zip(*rows, strict=True)])
    assert summed == _compare(ENGINE_TLK, trainer)
    assert summed == RoutingMismatch(pairs=6, mismatched_pairs=3, tokens=3, mismatched_tokens=2)


def test_ranks_aggregate_token_weighted() -> None:
    """Rank A: 1 token, 1 of 2 pairs differs (50%); rank B: 9 tokens, none differs. The step's
    value is 1 / 20 pairs, not the mean of 50% and 0%."""
    rank_a = RoutingMismatch(pairs=2, mismatched_pairs=1, tokens=1, mismatched_tokens=1)
    rank_b = RoutingMismatch(pairs=18, mismatched_pairs=0, tokens=9, mismatched_tokens=0)
    summed = [a + b for a, b in zip(rank_a.to_row(), rank_b.to_row(), strict=True)]
    metrics = RoutingMismatch.from_row(summed).metrics()
    assert metrics[MISMATCH_METRIC] == pytest.approx(1 / 20)
    assert metrics[MISMATCH_TOKENS_METRIC] == pytest.approx(1 / 10)
    assert (rank_a + rank_b).to_row() == summed


def test_nothing_compared_reports_nothing() -> None:
    assert RoutingMismatch().metrics() == {}
    assert routing_mismatch_of_sequences({}, {0: ENGINE_TLK}).counts() == RoutingMismatch()


def test_routing_map_to_sorted_compact_ids() -> None:
    routing_map = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    ids = expert_ids_from_routing_map(routing_map, 2)
    assert ids.dtype == torch.uint8
    assert ids.tolist() == [[1, 3], [0, 1], [2, 3]]
    with pytest.raises(ValueError, match="expected exactly 2"):
        expert_ids_from_routing_map(torch.tensor([[1, 0, 0, 0]]), 2)


def test_expert_id_dtype_is_the_smallest_that_fits() -> None:
    assert expert_id_dtype(256) == torch.uint8
    assert expert_id_dtype(257) == torch.int16
    with pytest.raises(ValueError):
        expert_id_dtype(2**15 + 1)

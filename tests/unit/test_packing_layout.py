"""Packed micro-batch layout (pure torch): boundaries, restarting positions, labels, row mapping."""

from __future__ import annotations

import pytest
import torch
from helpers.policy_losses import loss_extras

from megarl.algo.losses import AGG_MODES, policy_loss
from megarl.algo.policy_losses import POLICY_LOSS_NAMES
from megarl.batch import (
    RolloutBatch,
    build_micro_batch,
    collate,
    pack,
    per_token_to_response,
    response_values_to_BL,
)


def _batch() -> RolloutBatch:
    tokens = (
        torch.tensor([10, 11, 12, 13]),
        torch.tensor([20, 21, 22, 23, 24, 25]),
        torch.tensor([30, 31, 32]),
    )
    prompts = (2, 3, 1)
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=prompts,
        group_ids=torch.zeros(3),
        rewards=torch.zeros(3),
        advantages=torch.tensor([0.5, -1.0, 2.0]),
        engine_logprobs=tuple(
            torch.zeros(len(t) - p) for t, p in zip(tokens, prompts, strict=True)
        ),
    )


def test_pack_concatenates_with_restarting_positions():
    mb = pack(_batch(), [1, 0, 2], loss_weights=[1.0, 0.0, 1.0])
    assert mb.tokens_BL.tolist() == [[20, 21, 22, 23, 24, 25, 10, 11, 12, 13, 30, 31, 32]]
    assert mb.position_ids_BL.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2]]
    assert mb.cu_seqlens == (0, 6, 10, 13)
    assert mb.max_seqlen == 6 and mb.num_tokens == 13 and mb.is_packed
    # labels never cross a boundary: each sequence's last slot repeats its own last token
    assert mb.labels_BL.tolist() == [[21, 22, 23, 24, 25, 25, 11, 12, 13, 13, 31, 32, 32]]
    assert mb.loss_mask_BL[1].sum() == 0  # weight 0 (filler)
    assert mb.advantages_B.tolist() == [-1.0, 0.5, 2.0]


def test_a_packed_row_widens_with_one_tail_segment_and_the_same_loss_side():
    """What the interleaved pipeline runs: every micro-batch at one width."""
    mb = pack(_batch(), [1, 0], pad_id=0, length_multiple=4)  # 10 tokens + a tail of 2
    wide = mb.with_packed_width(16, pad_id=0)
    assert wide.tokens_BL.tolist() == [[20, 21, 22, 23, 24, 25, 10, 11, 12, 13, *[0] * 6]]
    assert wide.position_ids_BL.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    assert wide.labels_BL.shape == (1, 16) and wide.cu_seqlens == mb.cu_seqlens
    for name in ("loss_mask_BL", "response_mask_BL", "advantages_B"):
        assert torch.equal(getattr(wide, name), getattr(mb, name)), name
    values = torch.arange(16.0).unsqueeze(0)
    assert torch.equal(wide.to_rows(values), mb.to_rows(values[:, :12]))
    assert mb.with_packed_width(12, pad_id=0) is mb
    with pytest.raises(ValueError, match="shorter than the row's 12"):
        mb.with_packed_width(8, pad_id=0)
    with pytest.raises(ValueError, match="padded micro-batch"):
        collate(_batch(), [0, 1], pad_id=0).with_packed_width(16, pad_id=0)


def test_loss_side_tensors_equal_collate():
    batch = _batch()
    padded, packed = collate(batch, [1, 0, 2], pad_id=0), pack(batch, [1, 0, 2])
    for name in ("loss_mask_BL", "response_mask_BL", "advantages_B"):
        assert torch.equal(getattr(padded, name), getattr(packed, name)), name


def test_to_rows_maps_packed_values_back_and_keeps_gradients():
    batch = _batch()
    padded, packed = collate(batch, [1, 0, 2], pad_id=0), pack(batch, [1, 0, 2])
    # a per-token quantity that depends only on (sequence, position): token id * 10 + position
    flat = (packed.tokens_BL * 10 + packed.position_ids_BL).float().requires_grad_(True)
    rows = packed.to_rows(flat)
    expected = (padded.tokens_BL * 10 + padded.position_ids_BL).float()
    valid = torch.arange(6).unsqueeze(0) < torch.tensor([6, 4, 3]).unsqueeze(1)
    assert torch.equal(rows[valid], expected[valid])
    assert torch.all(rows[~valid] == 0)
    rows.sum().backward()
    assert flat.grad.tolist() == [[1.0] * 13]  # every packed token reached exactly once
    assert padded.to_rows(expected) is expected  # padded: identity


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_sequence_level_losses_see_the_same_sequences_packed_and_padded(name, agg):
    """Several sequences share one packed row, yet the loss side is one row per sequence
    (``to_rows``), so GSPO's sequence ratio and seq-mean-token-mean's ``1 / length`` are each
    sequence's own: loss and gradient equal the padded layout's."""
    batch = _batch()
    order, weights = [1, 0, 2], [1.0, 1.0, 0.0]
    padded = collate(batch, order, pad_id=0, loss_weights=weights)
    packed = pack(batch, order, loss_weights=weights)

    def logp(mb):  # a model output in the model layout: a function of (token, position)
        return -(mb.tokens_BL % 7 + mb.position_ids_BL).double() / 10

    def loss_and_grad(mb):
        model_out = logp(mb).requires_grad_(True)
        logp_BL = mb.to_rows(model_out)
        old_BL = mb.to_rows(logp(mb) + 0.05 * (mb.position_ids_BL % 3 - 1))
        adv_B = mb.advantages_B.double()
        extras = loss_extras(name, old_BL, adv_B, mb.loss_mask_BL)  # clip_cov, kl_cov, m2po
        out = policy_loss(logp_BL, old_BL, adv_B, mb.loss_mask_BL, agg=agg, loss=name, **extras)
        out.loss.backward()
        return out.loss.detach(), mb.to_rows(model_out.grad)

    padded_loss, padded_grad = loss_and_grad(padded)
    packed_loss, packed_grad = loss_and_grad(packed)
    assert padded_loss != 0
    torch.testing.assert_close(packed_loss, padded_loss)
    torch.testing.assert_close(packed_grad, padded_grad)


def test_response_extraction_round_trip_on_packed():
    batch = _batch()
    mb = build_micro_batch(batch, [2, 1], pad_id=0, packed=True)
    values = {2: torch.tensor([7.0, 8.0]), 1: torch.tensor([1.0, 2.0, 3.0])}
    rows = response_values_to_BL(values, mb, batch)
    back = per_token_to_response(rows, mb, batch)
    assert {k: v.tolist() for k, v in back.items()} == {k: v.tolist() for k, v in values.items()}


def test_build_micro_batch_padded_by_default():
    mb = build_micro_batch(_batch(), [0, 2], pad_id=0)
    assert not mb.is_packed and mb.tokens_BL.shape == (2, 4)


def test_sequence_dimension_pads_to_a_multiple_and_rows_read_the_same():
    """Sequence parallelism splits the sequence dimension: packed rows get a padding tail after
    the last sequence, padded rows more columns; what each sequence reads is unchanged."""
    batch = _batch()
    plain = pack(batch, [1, 0, 2])
    tailed = pack(batch, [1, 0, 2], pad_id=7, length_multiple=4)
    assert plain.tokens_BL.shape == (1, 13) and tailed.tokens_BL.shape == (1, 16)
    assert tailed.cu_seqlens == plain.cu_seqlens
    assert tailed.tokens_BL[0, 13:].tolist() == [7, 7, 7]
    assert tailed.position_ids_BL[0, 13:].tolist() == [0, 1, 2]
    values = torch.arange(16.0).unsqueeze(0)
    assert torch.equal(tailed.to_rows(values), plain.to_rows(values[:, :13]))
    wide = collate(batch, [1, 0, 2], pad_id=0, length_multiple=4)
    assert wide.tokens_BL.shape == (3, 8)
    narrow = collate(batch, [1, 0, 2], pad_id=0)
    assert torch.equal(wide.loss_mask_BL[:, :6], narrow.loss_mask_BL)
    assert not wide.loss_mask_BL[:, 6:].any()

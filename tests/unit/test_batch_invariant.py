"""The batch-invariant forms on plain tensors: the same numbers as torch's (to rounding), and a
row's or a query's bits the same whatever shares its call (bitwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.distributed import batch_invariant as bi


def test_attention_is_causal_attention():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(70, 2, 4, 32, generator=gen)
    k, v = (torch.randn(70, 2, 2, 32, generator=gen) for _ in range(2))
    q_, k_, v_ = (
        t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))
    )
    expected = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
    got = bi.attention(q, k, v)
    torch.testing.assert_close(got, expected.permute(2, 0, 1, 3).reshape(70, 2, -1))


def test_a_query_reads_the_same_bits_from_a_kv_cache_as_from_the_whole_sequence():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(130, 3, 6, 32, generator=gen)
    k, v = (torch.randn(130, 3, 2, 32, generator=gen) for _ in range(2))
    full = bi.attention(q, k, v)
    for t in (0, 5, 63, 64, 100, 129):
        step = bi.attention(q[t : t + 1], k[: t + 1], v[: t + 1])  # one decode step
        assert torch.equal(step[0], full[t])
        alone = bi.attention(q[t : t + 1, 1:2], k[: t + 1, 1:2], v[: t + 1, 1:2])
        assert torch.equal(alone[0, 0], full[t, 1])  # batch of one
    chunk = bi.attention(q[40:90], k[:90], v[:90])  # a chunk after a prefix
    assert torch.equal(chunk, full[40:90])


def test_linear_rows_do_not_depend_on_the_rows_beside_them():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 128, generator=gen)
    x = torch.randn(300, 128, generator=gen)
    full = bi.linear(x, weight)
    torch.testing.assert_close(full, F.linear(x, weight))
    for rows in (1, 2, 3, 5, 11, 64, 65, 113):
        assert torch.equal(bi.linear(x[:rows], weight), full[:rows])
        assert torch.equal(bi.matmul(x[:rows].unsqueeze(1), weight.t())[:, 0], full[:rows])


def test_sum_and_silu_elements_do_not_depend_on_the_call():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(8, 49152, generator=gen)
    assert torch.equal(bi.row_sum(x[:1], -1), bi.row_sum(x, -1)[:1])
    assert torch.equal(bi.row_sum(x[0], -1, keepdim=True), bi.row_sum(x, -1)[:1])
    y = torch.randn(1000, generator=gen) * 3
    full = bi.silu(y)
    torch.testing.assert_close(full, F.silu(y))
    assert all(torch.equal(bi.silu(y[:n]), full[:n]) for n in range(1, 100))


def test_the_mode_routes_torch_calls_and_is_free_when_off():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 128, generator=gen)
    x = torch.randn(200, 128, generator=gen)
    reference = bi.linear(x, weight)
    with bi.batch_invariant_mode():
        assert bi.enabled()
        assert torch.equal(F.linear(x[:7], weight), reference[:7])
        assert torch.equal(torch.matmul(x[:3], weight.t()), reference[:3])
    assert not bi.enabled()
    with bi.batch_invariant_mode(False):
        assert not bi.enabled()


def _left_padded_mask(pads: list[int], tq: int, tk: int) -> torch.Tensor:
    keys, columns = torch.arange(tk), torch.arange(tk - tq, tk)
    pad_B = torch.tensor(pads)
    allowed = (keys[None, None] >= pad_B[:, None, None]) & (keys[None] <= columns[:, None])[None]
    return ~allowed.unsqueeze(1)


def test_left_padded_rows_read_the_bits_of_their_unpadded_sequences():
    """The Megatron engine's batches: rows left-padded to one width, an explicit mask."""
    gen = torch.Generator().manual_seed(5)
    pads, width = [0, 3, 70], 80
    q = torch.randn(width, 3, 4, 32, generator=gen)
    k, v = (torch.randn(width, 3, 2, 32, generator=gen) for _ in range(2))
    prefill = bi.left_padded_attention(q, k, v, _left_padded_mask(pads, width, width))
    step = bi.left_padded_attention(q[-1:], k, v, _left_padded_mask(pads, 1, width))
    assert torch.isfinite(prefill).all()
    for row, pad in enumerate(pads):
        one = slice(row, row + 1)
        alone = bi.attention(q[pad:, one], k[pad:, one], v[pad:, one])
        assert torch.equal(prefill[pad:, one], alone)
        assert torch.equal(step[:, one], alone[-1:])


def test_an_unexpected_mask_is_refused():
    mask = _left_padded_mask([0, 2], 6, 6)
    mask[0, 0, 3, 1] = True  # a real query that may not see a key before it
    q, k = torch.randn(6, 2, 2, 32), torch.randn(6, 2, 2, 32)
    with pytest.raises(NotImplementedError, match="left-padded causal"):
        bi.left_padded_attention(q, k, k, mask)

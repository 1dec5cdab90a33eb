"""Batch-invariant forward paths: a token's numbers do not depend on what shares its call.

A CPU kernel may reduce in an order that depends on the shape of the call: how many rows a
matrix product has, how many keys an attention reads, how long a vectorised loop's tail is. Then
a token's logprob differs in the last bits between the engine's decode (one new token per
sequence, attention over a KV cache) and the trainer's forward (whole sequences, packed or
padded, in micro-batches of any size), and ``rollout/logprob_abs_diff`` is ~1e-7..1e-5 instead
of 0. Under :func:`batch_invariant_mode` every reduction of the forward runs in an order fixed
by the model alone. What ``benchmarks/probe_batch_invariance.py`` measured on this machine
(torch 2.13 CPU, MKL 2024.2, AVX-512, 2 threads), and what each finding makes this module do:

- **Matrix products** (``F.linear``, ``torch.matmul``) with two threads give a row other bits
  when the call has 1-3, 5, 7, 9, 10 or 11 rows (~1.5e-6), and which rows of a larger call
  agree depends on how MKL splits the rows between threads (a 16-row call and a 113-row call
  disagreed in a TP=2 rank while the 11- and 113-row calls agreed). What does hold: in calls of
  one fixed shape, a row's bits do not depend on its slot or on the other rows (every slot of
  16-, 32- and 64-row blocks, K up to 1536, N up to 49152, one or two threads). So
  :func:`linear` and :func:`matmul` cut the rows into blocks of :data:`ROW_BLOCK` (the last one
  zero-padded) and multiply block by block: every product has one shape.
- **Attention**: ``scaled_dot_product_attention`` over a KV cache differs from the causal pass
  over the whole sequence (~5e-7): the kernel splits the keys by the call's length.
  :func:`attention` reads keys in blocks of :data:`KEY_BLOCK` aligned at position 0 (the last
  block zero-padded) and, for each sequence and key/value group, computes a key block's scores
  and weighted values as fixed-shape products (the queries of the group's heads in blocks of
  :data:`ROW_BLOCK` rows, as for the linear layers). The softmax takes the row's exact max over
  every allowed key, then ``exp``, and adds the blocks' numerators and denominators one block
  after the other, in position order. A key a query may not see gets ``-inf``, so its weight is
  an exact 0 and a block past the query's position adds exact zeros: a query reads the same bits
  from a cache of ``t + 1`` keys as from a packed, padded or longer causal pass. The causal
  mask is aligned bottom-right (the last query sits at the last key), which is the plain
  causal mask for a whole sequence and the right one for a decode step or a chunk.
- **Element-wise ops**: ``exp``, ``log``, ``sin``, ``cos`` and ``rsqrt`` give every element the
  same bits whatever the tensor's length; ``silu`` and ``sigmoid`` do not (their vectorised
  loops finish a ragged tail with other code: 3e-8). :func:`silu` pads the flattened tensor to
  a multiple of :data:`ELEMENTWISE_MULTIPLE` so every element takes the vectorised path.
- **Sums over the last dimension**: a sum to a single number (one token's sum over the 49152
  entries of the vocabulary) is split between threads and differs from the same row's sum in
  a call of several rows; :func:`row_sum` pads such a sum to :data:`MIN_REDUCE_ROWS` rows.
  Sums of several rows, torch's RMSNorm (hidden 128 and 576), softmax and log-softmax are
  row-invariant already: untouched.
- **Tensor parallelism**: gloo's all-reduce of two ranks' partial sums equals ``a + b`` bitwise
  (for every buffer size), and ``a + b == b + a`` in IEEE arithmetic: exact at TP=2. With more
  than two ranks the order of a ring all-reduce depends on the buffer's chunking; not claimed.

These are facts of this machine's kernels, not of every machine's: the equalities are proven
by ``tests/integration/test_batch_invariant_run.py`` (Megatron model, decode vs training forward,
packed vs padded, micro-batch sizes, TP=1 and 2) and a GPU needs its own kernels (verl and
NeMo-RL use Triton batch-invariant GEMMs there). Everything here is a forward path; gradients
flow through it unchanged (the padding's rows get none).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 64
"""Rows of every matrix product: the rows are cut into blocks of this many (the last one
zero-padded), one product per block, so every product has the same shape."""

KEY_BLOCK = 64
"""Keys per attention block: every score and value sum runs over this many keys."""

ELEMENTWISE_MULTIPLE = 64
"""Element-wise ops with a ragged vectorised tail run on a length padded to a multiple of this."""

MIN_REDUCE_ROWS = 2
"""Fewest rows a sum over the last dimension runs with: a sum to one number is split between
threads, a sum to several gives each number to one thread."""

_enabled = 0


def enabled() -> bool:
    """Whether a :func:`batch_invariant_mode` is open (the attention core asks)."""
    return _enabled > 0


def _pad_dim(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``tensor`` zero-padded along ``dim`` to ``size`` (itself when it is that long)."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _rows(tensor: torch.Tensor) -> int:
    return tensor.numel() // tensor.shape[-1] if tensor.shape[-1] else 0


def _blocked_rows(left: torch.Tensor, product) -> torch.Tensor:
    """``product`` applied to ``left``'s rows :data:`ROW_BLOCK` at a time, every call the same
    shape; the result has ``left``'s leading dimensions."""
    rows = _rows(left)
    if rows == 0:
        return product(left)
    flat = left.reshape(rows, left.shape[-1])
    flat = _pad_dim(flat, 0, math.ceil(rows / ROW_BLOCK) * ROW_BLOCK)
    out = torch.cat([product(block) for block in flat.split(ROW_BLOCK)])[:rows]
    return out.reshape(*left.shape[:-1], out.shape[-1])


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` whose rows do not depend on how many share the call."""
    return _blocked_rows(input, lambda block: F.linear(block, weight, bias))


def matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(left, right)`` for a matrix ``right`` (Megatron's linear layers), in
    fixed-shape row blocks; other products are left to torch."""
    if left.dim() < 2 or right.dim() != 2:
        return torch.matmul(left, right)
    return _blocked_rows(left, lambda block: torch.mm(block, right))


def row_sum(input: torch.Tensor, dim, keepdim: bool = False, **kwargs) -> torch.Tensor:
    """``input.sum(dim)`` with at least :data:`MIN_REDUCE_ROWS` results for a sum over the last
    dimension (other sums are left to torch)."""
    last = dim in (-1, input.dim() - 1) or (
        isinstance(dim, (tuple, list)) and len(dim) == 1 and dim[0] in (-1, input.dim() - 1)
    )
    rows = _rows(input) if input.dim() else 0
    if not last or rows == 0 or rows >= MIN_REDUCE_ROWS:
        return torch.sum(input, dim, keepdim=keepdim, **kwargs)
    flat = _pad_dim(input.reshape(rows, input.shape[-1]), 0, MIN_REDUCE_ROWS)
    out = torch.sum(flat, -1, **kwargs)[:rows]
    return out.reshape(*input.shape[:-1], *((1,) if keepdim else ()))


def silu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.silu`` with every element on the vectorised path (no ragged tail)."""
    del inplace  # the padded copy is new memory either way
    flat = input.reshape(-1)
    padded = _pad_dim(
        flat, 0, math.ceil(flat.numel() / ELEMENTWISE_MULTIPLE) * ELEMENTWISE_MULTIPLE
    )
    return F.silu(padded.contiguous())[: flat.numel()].reshape(input.shape)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention, bottom-right aligned, whose per-query result does not depend on how
    many queries or keys the call holds (module docstring).

    Megatron's layout: ``query [tq, b, heads, d]``, ``key``/``value [tk, b, groups, d]``
    (``tk >= tq``; query ``i`` sits at position ``tk - tq + i``); returns ``[tq, b, heads * d]``.
    The queries of the heads that share a key/value group are the rows of one product.
    """
    tq, batch, heads, dim = query.shape
    tk, groups = key.shape[0], key.shape[2]
    rep = heads // groups
    factor = dim**-0.5 if scale is None else scale
    # [b, groups, rep * tq, d]: row r * tq + i is head (group * rep + r), query i
    q = query.reshape(tq, batch, groups, rep, dim).permute(1, 2, 3, 0, 4)
    q = q.reshape(batch, groups, rep * tq, dim)
    num_blocks = math.ceil(tk / KEY_BLOCK)
    k, v = (
        _pad_dim(t.permute(1, 2, 0, 3), 2, num_blocks * KEY_BLOCK) for t in (key, value)
    )  # [b, groups, blocks * KEY_BLOCK, d]
    # a query before the row's first key (a left pad's column) reads key 0: finite, unused
    q_pos = (torch.arange(tq, device=query.device) + (tk - tq)).clamp(min=0).repeat(rep)
    out = torch.stack(
        [
            torch.stack(
                [_attend_group(q[i, j], k[i, j], v[i, j], q_pos, factor) for j in range(groups)]
            )
            for i in range(batch)
        ]
    )  # [b, groups, rep * tq, d]
    out = out.reshape(batch, groups, rep, tq, dim)
    return out.permute(3, 0, 1, 2, 4).reshape(tq, batch, heads * dim)


def _attend_group(
    q_MD: torch.Tensor, k_KD: torch.Tensor, v_KD: torch.Tensor, q_pos_M: torch.Tensor, factor: float
) -> torch.Tensor:
    """One key/value group of one sequence: ``[rows, d]`` queries at positions ``q_pos_M`` over
    ``[blocks * KEY_BLOCK, d]`` keys; every product is a fixed-shape one (:func:`_blocked_rows`)."""
    scores = []
    for start in range(0, k_KD.shape[0], KEY_BLOCK):
        k_pos = torch.arange(start, start + KEY_BLOCK, device=q_MD.device)
        hidden = k_pos.unsqueeze(0) > q_pos_M.unsqueeze(1)  # [rows, KEY_BLOCK]
        keys_DK = k_KD[start : start + KEY_BLOCK].t()
        block = _blocked_rows(q_MD, lambda rows, keys_DK=keys_DK: torch.mm(rows, keys_DK))
        scores.append((block * factor).masked_fill(hidden, float("-inf")))
    row_max = scores[0].amax(-1, keepdim=True)
    for block in scores[1:]:
        row_max = torch.maximum(row_max, block.amax(-1, keepdim=True))
    numerator = denominator = None
    for index, block in enumerate(scores):
        weights = torch.exp(block - row_max)  # [rows, KEY_BLOCK]; hidden keys exactly 0
        values = v_KD[index * KEY_BLOCK : (index + 1) * KEY_BLOCK]
        part = _blocked_rows(weights, lambda rows, values=values: torch.mm(rows, values))
        total = weights.sum(-1, keepdim=True)
        numerator = part if numerator is None else numerator + part
        denominator = total if denominator is None else denominator + total
    assert numerator is not None and denominator is not None  # at least one block
    return numerator / denominator


def left_pads(attention_mask: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """Each row's left padding, read from an explicit mask ``[b, 1, tq, tk]`` (True = masked)
    that must be the left-padded causal one (a row's real query at column ``c`` sees keys
    ``pad..c``; what a pad's query sees does not matter); anything else is refused."""
    allowed = ~attention_mask.to(torch.bool)[:, 0]  # [b, tq, tk]
    pad_B = allowed[:, -1].int().argmax(-1)  # the last query is a real token's
    keys = torch.arange(tk, device=allowed.device)
    columns = torch.arange(tk - tq, tk, device=allowed.device)
    expected = (keys[None, None] >= pad_B[:, None, None]) & (keys[None] <= columns[:, None])[None]
    real_BQ = columns[None] >= pad_B[:, None]
    if not torch.equal(allowed[real_BQ], expected[real_BQ]):
        raise NotImplementedError(
            "batch-invariant attention takes no attention_mask but a left-padded causal one"
        )
    return pad_B


def left_padded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention` of rows left-padded to one width (the engine's batches): each row
    attends from its own first real key, so its keys fall in the blocks they have in the
    trainer's forward; a pad's query gets a finite value nobody reads."""
    tq, tk = query.shape[0], key.shape[0]
    pads = left_pads(attention_mask, tq, tk).tolist()
    rows = []
    for row, pad in enumerate(pads):
        keys = slice(min(pad, tk - 1), tk)
        one = slice(row, row + 1)
        rows.append(attention(query[:, one], key[keys, one], value[keys, one], scale))
    return torch.cat(rows, dim=1)


_MATMULS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
)
_SUMS = frozenset({torch.sum, torch.Tensor.sum})


class BatchInvariantMode(TorchFunctionMode):
    """Routes the forward's matrix products, last-dimension sums and ``silu`` through this module's invariant forms
    (attention is routed by the core attention module, which asks :func:`enabled`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "out" not in kwargs:
            if func is F.linear:
                return linear(*args, **kwargs)
            if func in _MATMULS and not kwargs:
                return matmul(*args)
            if func is F.silu:
                return silu(*args, **kwargs)
            if func in _SUMS and (len(args) > 1 or "dim" in kwargs):
                return row_sum(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """The forward inside runs batch-invariant (module docstring); a no-op when not ``enabled``,
    so the default path pays nothing."""
    global _enabled
    if not enabled:
        yield
        return
    _enabled += 1
    try:
        with BatchInvariantMode():
            yield
    finally:
        _enabled -= 1

"""Generation's forward: a Megatron ``GPTModel`` run over a KV cache, one call per prefill or step.

This is the one place where generation runs the model (:mod:`megarl.engines.megatron` drives it).
It goes through the very modules the trainer's forward goes through -- the embedding, every
``TransformerLayer`` of the decoder (attention with the core attention of the layer spec, which
is :class:`megarl.distributed.platform.SDPACoreAttention` on CPU; the MLP or the MoE layer; any
LoRA adapters in the linear layers), the final norm and the output layer -- so equal weights
give the trainer's numbers up to summation order. Only the KV cache and the per-row positions
are generation's own.

**The cache is Megatron's** ``StaticInferenceContext``, with one change: the keys it holds are
rotated. Megatron's own ``SelfAttention._adjust_key_value_for_inference`` stores keys before RoPE
and rotates every cached key again at every step, which was about a third of a decode call on
SmolLM2 (``benchmarks/RESULTS.md``). :func:`store_rotated` takes its place while generation runs
(:func:`rotated_key_cache`): it rotates the new columns' keys once, writes them and the values
into the context's buffers at ``sequence_len_offset``, and hands attention every column so far
with nothing left to rotate but the query. RoPE is elementwise, so a key rotated when it is
stored is the same bits as one rotated later. This is the one function where attention meets
the cache.

**Rows of different lengths** are left-padded to one width ``T`` (each row's last context token
in the last column), as the HF engine does, and Megatron is told two things per row that its
static batching assumes equal for all rows:

* positions: column ``c`` of a row padded by ``p`` is position ``c - p``. RoPE frequencies are
  therefore passed per (column, row), ``[C, B, 1, dim]``, which Megatron's rotary application
  broadcasts over the heads exactly as its own ``[C, 1, 1, dim]``; it slices them by column.
* attention: an explicit mask (Megatron's convention, True = masked) hides a row's pad columns
  and, in the prefill, the future. A pad column attends to itself alone: a query that may attend
  to nothing gives NaN in ``scaled_dot_product_attention``, and a NaN key or value poisons the
  real queries that mask it out (their weight for it is 0, but 0 * NaN is NaN).

Under pipeline parallelism each stage runs its own layers with its own part of the cache and
passes the hidden states on with a send/receive pair (the logits exist on the last stage).

Rows leave the batch when they end (:meth:`KVCache.select_rows`): the buffers, pads and
frequencies are indexed down, so later steps compute only the rows still going.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


def row_positions(start: int, end: int, pad_B: torch.Tensor) -> torch.Tensor:
    """``[B, end - start]`` positions of columns ``start..end-1`` of rows left-padded by
    ``pad_B``: ``column - pad``, 0 on pad columns (their value never matters: masked)."""
    columns = torch.arange(start, end, device=pad_B.device)
    return (columns.unsqueeze(0) - pad_B.unsqueeze(1)).clamp(min=0)


def attention_mask(start: int, end: int, pad_B: torch.Tensor) -> torch.Tensor:
    """``[B, 1, end - start, end]`` boolean mask, True = masked, of queries at columns
    ``start..end-1`` over keys at columns ``0..end-1``: causal, pad keys hidden, and a pad
    query attends to itself alone (see the module docstring)."""
    keys = torch.arange(end, device=pad_B.device)
    queries = torch.arange(start, end, device=pad_B.device)
    real_key_BK = keys.unsqueeze(0) >= pad_B.unsqueeze(1)
    causal_QK = keys.unsqueeze(0) <= queries.unsqueeze(1)
    itself_QK = keys.unsqueeze(0) == queries.unsqueeze(1)
    allowed_BQK = (real_key_BK.unsqueeze(1) & causal_QK) | itself_QK
    return ~allowed_BQK.unsqueeze(1)


class KVCache:
    """Megatron's static KV cache for one batch of left-padded rows, up to ``capacity`` columns,
    with each row's pad and RoPE frequencies."""

    def __init__(self, gpt: Any, pad_B: torch.Tensor, capacity: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        self.context = StaticInferenceContext(len(pad_B), capacity)
        self.pad_B = pad_B
        self.capacity = capacity
        self.filled = 0
        """Columns written so far: the next forward's first column."""
        table_C11D = gpt.rotary_pos_emb(capacity)  # Megatron's own frequencies per position
        positions_CB = row_positions(0, capacity, pad_B).T.to(table_C11D.device)
        self.rope_CB1D = table_C11D[positions_CB].squeeze(2)

    @property
    def num_rows(self) -> int:
        return len(self.pad_B)

    def select_rows(self, index_B: torch.Tensor) -> None:
        """Keep (or repeat) the rows ``index_B`` names, in that order."""
        cached = self.context.key_value_memory_dict
        for layer, (keys, values) in cached.items():
            cached[layer] = (keys[:, index_B.to(keys.device)], values[:, index_B.to(keys.device)])
        self.pad_B = self.pad_B[index_B.to(self.pad_B.device)]
        self.rope_CB1D = self.rope_CB1D[:, index_B.to(self.rope_CB1D.device)]
        self.context.max_batch_size = len(index_B)

    def forward(self, gpt: Any, tokens_BS: torch.Tensor) -> torch.Tensor | None:
        """Run ``S`` new columns of every row through this rank's ``gpt`` (a bare ``GPTModel``:
        its pipeline stage), extending the cache; the ``[B, V/tp]`` logits of the last column
        (this tensor-parallel rank's vocabulary slice) on the last stage, None on the others.

        Under pipeline parallelism every stage of the group calls this with the same tokens:
        a stage after the first receives the hidden states from the stage before it, and each
        stage before the last sends its own on."""
        start, end = self.filled, self.filled + tokens_BS.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} columns; asked for {end}")
        context = self.context
        context.sequence_len_offset = start
        if start == 0:
            context.enable_prefill_mode()
        else:
            context.enable_decode_mode()
        if gpt.pre_process:
            hidden_SBH = gpt.embedding(input_ids=tokens_BS, position_ids=None)
        else:
            hidden_SBH = _receive_hidden(gpt, tokens_BS.shape)
            gpt.decoder.set_input_tensor(hidden_SBH)
        with rotated_key_cache(gpt):
            hidden_SBH = gpt.decoder(
                hidden_states=hidden_SBH,
                attention_mask=attention_mask(start, end, self.pad_B).to(tokens_BS.device),
                inference_context=context,
                rotary_pos_emb=self.rope_CB1D,
            )
        self.filled = end
        if not gpt.post_process:
            _send_hidden(hidden_SBH)
            return None
        weight = None
        if gpt.share_embeddings_and_output_weights:
            weight = gpt.shared_embedding_or_output_weight()
        logits_1BV, _ = gpt.output_layer(hidden_SBH[-1:], weight=weight)
        return logits_1BV[0]


@contextlib.contextmanager
def rotated_key_cache(gpt: Any) -> Iterator[None]:
    """Every ``SelfAttention`` of ``gpt`` keeps rotated keys in the cache (:func:`store_rotated`)
    for the block; Megatron's own method again after it."""
    from megatron.core.transformer.attention import SelfAttention

    attentions: list[Any] = [m for m in gpt.modules() if isinstance(m, SelfAttention)]
    for attention in attentions:
        attention._adjust_key_value_for_inference = functools.partial(store_rotated, attention)
    try:
        yield
    finally:
        for attention in attentions:
            del attention._adjust_key_value_for_inference


def store_rotated(
    attention: Any,
    inference_context: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    rotary_pos_emb: tuple[torch.Tensor, torch.Tensor | None] | None,
    *_unused: Any,
    **_unused_kw: Any,
) -> tuple:
    """``SelfAttention._adjust_key_value_for_inference`` of Megatron's static batching, keys
    stored rotated: the new columns' keys rotated with their own frequencies and written with
    the values at ``sequence_len_offset``; returns the query, every cached column's keys and
    values, the query's frequencies alone (the keys need none), the mask type and no block
    table, as Megatron's does."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from megatron.core.transformer.enums import AttnMaskType

    context = inference_context
    start, end = context.sequence_len_offset, context.sequence_len_offset + key.size(0)
    cached = context.key_value_memory_dict.get(attention.layer_number)
    if cached is None:
        capacity, rows = context.max_sequence_length, context.max_batch_size
        cached = (
            attention._allocate_memory(capacity, rows, attention.key_hidden_size, key.dtype),
            attention._allocate_memory(capacity, rows, attention.val_hidden_size, value.dtype),
        )
        context.key_value_memory_dict[attention.layer_number] = cached
    keys, values = cached
    if rotary_pos_emb is not None:
        q_pos_emb, k_pos_emb = rotary_pos_emb
        assert k_pos_emb is not None  # generation passes one table for queries and keys
        key = apply_rotary_pos_emb(
            key,
            k_pos_emb[start:end],
            config=attention.config,
            mscale=_yarn_get_concentration_factor_from_config(attention.config),
            cp_group=attention.pg_collection.cp,
        )
        rotary_pos_emb = (q_pos_emb[start:end], None)
    keys[start:end] = key
    values[start:end] = value
    mask_type = AttnMaskType.no_mask if start > 0 else attention.attn_mask_type
    return query, keys[:end], values[:end], rotary_pos_emb, mask_type, None


def _receive_hidden(gpt: Any, tokens_shape: torch.Size) -> torch.Tensor:
    """The ``[S, B, H]`` hidden states of the previous pipeline stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    batch, seq = tokens_shape
    config = gpt.config
    hidden_SBH = torch.empty(
        (seq, batch, config.hidden_size),
        dtype=config.pipeline_dtype or config.params_dtype,
        device=next(gpt.parameters()).device,
    )
    dist.recv(hidden_SBH, src=parallel_state.get_pipeline_model_parallel_prev_rank())
    return hidden_SBH


def _send_hidden(hidden_SBH: torch.Tensor) -> None:
    """This stage's hidden states to the next pipeline stage."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.send(hidden_SBH.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())

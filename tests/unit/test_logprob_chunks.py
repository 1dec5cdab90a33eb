"""Chunked vocab logprobs/entropy: equal to unchunked (values and grads), memory bounded by a chunk.

Memory is measured by a dispatch mode that tracks every fp32 tensor the computation creates and
when it is freed (weak references): the peak of live fp32 bytes. Unchunked, it grows with
``tokens x vocab``; chunked (and checkpointed when training), with ``chunk x vocab``.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.models.vocab_parallel import VocabShard, token_logprobs_and_entropy

TOKENS, VOCAB, CHUNK = 256, 1000, 32
SHARD = VocabShard(start=0, real_vocab_size=990)  # last 10 entries are padding


class LiveFp32Bytes(TorchDispatchMode):
    """Peak bytes of live fp32 tensors created under the mode (views of inputs not counted)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: set[int] = set()

    def _release(self, key: int, size: int) -> None:
        self.live -= size
        self._storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                continue
            key = t.untyped_storage().data_ptr()
            if key in self._storages or key == 0:
                continue
            size = t.untyped_storage().nbytes()
            self._storages.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t.untyped_storage(), self._release, key, size)
        return out


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, TOKENS // 2, VOCAB, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, 990, (2, TOKENS // 2), generator=gen)
    return logits, targets


def _loss_and_grad(chunk: int, dtype=torch.float32):
    logits, targets = _inputs(dtype)
    logits.requires_grad_(True)
    logp, ent = token_logprobs_and_entropy(
        logits, targets, SHARD, temperature=0.7, chunk_tokens=chunk
    )
    (logp.sum() * 0.3 + ent.sum() * 0.1).backward()
    return logp.detach(), ent.detach(), logits.grad


def test_chunked_equals_unchunked_values_and_grads():
    lp_full, ent_full, grad_full = _loss_and_grad(TOKENS)
    lp_chunk, ent_chunk, grad_chunk = _loss_and_grad(CHUNK)
    assert torch.allclose(lp_full, lp_chunk, atol=1e-6, rtol=0)
    assert torch.allclose(ent_full, ent_chunk, atol=1e-6, rtol=0)
    assert torch.allclose(grad_full, grad_chunk, atol=1e-7, rtol=0)
    reference = (
        torch.log_softmax(_inputs()[0][..., :990] / 0.7, -1)
        .gather(-1, _inputs()[1].unsqueeze(-1))
        .squeeze(-1)
    )
    assert torch.allclose(lp_chunk, reference, atol=1e-5)


def _peak_bytes(chunk: int, train: bool) -> int:
    logits, targets = _inputs(torch.bfloat16)
    logits.requires_grad_(train)
    mode = LiveFp32Bytes()
    with mode, torch.set_grad_enabled(train):
        logp, ent = token_logprobs_and_entropy(logits, targets, SHARD, chunk_tokens=chunk)
        if train:
            (logp.sum() + ent.sum()).backward()
        del logp, ent
    return mode.peak


@pytest.mark.parametrize("train", [False, True], ids=["forward", "forward+backward"])
def test_peak_fp32_memory_is_bounded_by_the_chunk(train):
    chunk_bytes = CHUNK * VOCAB * 4
    full_bytes = TOKENS * VOCAB * 4
    chunked = _peak_bytes(CHUNK, train)
    unchunked = _peak_bytes(TOKENS, train)
    # measured: ~5 (forward) / ~6 (training) live [chunk, V] fp32 temporaries at the peak
    assert chunked <= 8 * chunk_bytes, (chunked, chunk_bytes)
    assert unchunked >= 4 * full_bytes, (unchunked, full_bytes)  # the measurement sees them

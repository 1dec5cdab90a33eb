"""Rollout batches of random tokens for the actor tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def random_batch(
    seq_lens: Sequence[int],
    prompt_lens: Sequence[int],
    vocab_size: int,
    advantages: torch.Tensor,
    seed: int,
    group_ids: torch.Tensor | None = None,
):
    """A ``RolloutBatch`` of sequences of ``seq_lens`` random tokens (ids from 3, drawn in
    order from a generator seeded ``seed``), zero rewards and zero engine logprobs; one group
    unless ``group_ids`` says."""
    from megarl.batch import RolloutBatch

    gen = torch.Generator().manual_seed(seed)
    tokens = tuple(torch.randint(3, vocab_size, (n,), generator=gen) for n in seq_lens)
    num = len(seq_lens)
    return RolloutBatch(
        tokens=tokens,
        prompt_lens=tuple(prompt_lens),
        group_ids=torch.zeros(num) if group_ids is None else group_ids,
        rewards=torch.zeros(num),
        advantages=advantages,
        engine_logprobs=tuple(
            torch.zeros(n - p) for n, p in zip(seq_lens, prompt_lens, strict=True)
        ),
    )

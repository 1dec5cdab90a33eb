"""The typed data that moves between the driver, the rollout engine and the Megatron ranks.

Pure torch (no distributed): a :class:`RolloutBatch` is built once per step on the driver,
broadcast to every rank, and each rank :func:`collate` s the sequences of its micro-batches.

Token/position convention: a sequence is ``prompt + response`` (length ``S = P + R``). The
logit at position ``t`` predicts token ``t + 1``, so response token ``j`` (at position
``P + j``) is scored by the logit at ``P - 1 + j``. ``labels[t] = tokens[t + 1]`` and the loss
mask is 1 exactly at ``t in [P - 1, S - 2]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts; identical on every rank."""

    tokens: tuple[torch.Tensor, ...]
    """Per sequence: prompt + response token ids (int64, 1-D)."""
    prompt_lens: tuple[int, ...]
    group_ids: torch.Tensor
    """[N] which prompt each sequence answers (GRPO groups)."""
    rewards: torch.Tensor
    """[N] scalar reward per sequence."""
    advantages: torch.Tensor
    """[N] per-sequence advantage (exactly 0 for all-equal groups)."""
    engine_logprobs: tuple[torch.Tensor, ...]
    """Per sequence: the rollout engine's logprob of each response token."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        sizes = {len(self.prompt_lens), len(self.group_ids), len(self.rewards),
                 len(self.advantages), len(self.engine_logprobs)}
        if sizes != {n}:
            raise ValueError(f"RolloutBatch fields disagree on the number of sequences: {sizes}")
        for i, (toks, plen, lp) in enumerate(zip(self.tokens, self.prompt_lens,
                                                 self.engine_logprobs, strict=True)):
            if len(toks) - plen != len(lp) or len(lp) < 1:
                raise ValueError(f"sequence {i}: {len(toks)} tokens, prompt {plen}, "
                                 f"{len(lp)} response logprobs")

    @property
    def num_seqs(self) -> int:
        return len(self.tokens)

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def response_lens(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lens, strict=True)]


@dataclass(frozen=True)
class MicroBatchTensors:
    """Right-padded model inputs for a set of sequences."""

    seq_indices: tuple[int, ...]
    tokens_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    labels_BL: torch.Tensor
    loss_mask_BL: torch.Tensor
    """1.0 where the label is a response token, times the sequence's loss weight."""
    response_mask_BL: torch.Tensor
    """1.0 where the label is a response token (weights not applied): for metrics and extraction."""
    advantages_B: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_BL.numel())


def collate(batch: RolloutBatch, seq_indices: Sequence[int], pad_id: int,
            loss_weights: Sequence[float] | None = None) -> MicroBatchTensors:
    """Pad the chosen sequences to a common length and build labels and masks."""
    seq_indices = tuple(int(i) for i in seq_indices)
    weights = loss_weights if loss_weights is not None else [1.0] * len(seq_indices)
    length = max(len(batch.tokens[i]) for i in seq_indices)
    num = len(seq_indices)
    tokens = torch.full((num, length), pad_id, dtype=torch.long)
    labels = torch.full((num, length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((num, length), dtype=torch.float32)
    for row, i in enumerate(seq_indices):
        seq = batch.tokens[i]
        size, plen = len(seq), batch.prompt_lens[i]
        tokens[row, :size] = seq
        labels[row, : size - 1] = seq[1:]
        response_mask[row, plen - 1 : size - 1] = 1.0
    weight_B = torch.tensor(list(weights), dtype=torch.float32)
    return MicroBatchTensors(
        seq_indices=seq_indices,
        tokens_BL=tokens,
        position_ids_BL=torch.arange(length).unsqueeze(0).expand(num, -1).contiguous(),
        labels_BL=labels,
        loss_mask_BL=response_mask * weight_B.unsqueeze(1),
        response_mask_BL=response_mask,
        advantages_B=batch.advantages[list(seq_indices)].float(),
    )


def per_token_to_response(values_BL: torch.Tensor, mb: MicroBatchTensors,
                          batch: RolloutBatch) -> dict[int, torch.Tensor]:
    """Cut each row's response part out of a [B, L] per-token tensor, keyed by sequence index."""
    out: dict[int, torch.Tensor] = {}
    for row, i in enumerate(mb.seq_indices):
        plen, size = batch.prompt_lens[i], len(batch.tokens[i])
        out[i] = values_BL[row, plen - 1 : size - 1].detach().clone()
    return out


def response_values_to_BL(values: dict[int, torch.Tensor], mb: MicroBatchTensors,
                          batch: RolloutBatch) -> torch.Tensor:
    """Inverse of :func:`per_token_to_response`: place per-sequence response values in [B, L]."""
    out = torch.zeros_like(mb.loss_mask_BL)
    for row, i in enumerate(mb.seq_indices):
        plen, size = batch.prompt_lens[i], len(batch.tokens[i])
        out[row, plen - 1 : size - 1] = values[i]
    return out

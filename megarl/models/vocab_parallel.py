"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Log-softmax needs
the max and the sum of exponentials over the *whole* vocabulary: we all-reduce those two
per-token scalars instead of the logits. The padded tail of the vocabulary (rows Megatron adds so
TP ranks get equal slices) is masked out, so padding never leaks probability mass.

Work is done in chunks of tokens (``chunk_tokens``) so fp32 logits for a whole packed
micro-batch are never materialised at once beyond one chunk (a common OOM at large vocabularies).
When gradients are needed each chunk is checkpointed: autograd keeps only the chunk's input (a
view of the model's logits) and recomputes the fp32 intermediates in backward, so the live fp32
memory stays at one chunk's worth in training too, not ``tokens x vocab`` spread over chunks.
Every TP rank runs the same chunks in the same order forward and backward, so the per-chunk
collectives (re-run during recomputation) still pair up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """Which slice of the vocabulary this rank's logits cover."""

    start: int
    """Global index of this rank's first vocabulary entry."""
    real_vocab_size: int
    """Entries at or beyond this global index are padding and are masked."""
    group: object | None = None
    """The tensor-parallel process group (None: no TP, plain single-rank math)."""


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """All-reduce in forward; identity in backward (each rank owns the grad of its own slice)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return tensor
    return _AllReduceSumIdentityGrad.apply(tensor, group)


def _all_reduce_max_(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def _padding_mask(num_local: int, shard: VocabShard, device) -> torch.Tensor | None:
    pad_from = shard.real_vocab_size - shard.start
    if pad_from >= num_local:
        return None
    idx = torch.arange(num_local, device=device)
    return idx >= pad_from


def _chunk_logprobs_entropy(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    shard: VocabShard,
    temperature: float,
    with_entropy: bool,
):
    logits = logits_NV.float()
    if temperature != 1.0:
        logits = logits / temperature
    pad = _padding_mask(logits.shape[-1], shard, logits.device)
    if pad is not None:
        logits = logits.masked_fill(pad, float("-inf"))
    max_N = _all_reduce_max_(logits.detach().max(dim=-1).values, shard.group)
    shifted = logits - max_N.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp_N = _all_reduce_sum(exp.sum(dim=-1), shard.group)
    local_target = targets_N - shard.start
    in_shard = (local_target >= 0) & (local_target < logits.shape[-1])
    picked = shifted.gather(-1, local_target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1))
    picked = picked.squeeze(-1) * in_shard
    target_shifted_N = _all_reduce_sum(picked, shard.group)
    log_z_N = sum_exp_N.log()
    logp_N = target_shifted_N - log_z_N
    if not with_entropy:
        return logp_N, None
    safe_shifted = shifted.masked_fill(pad, 0.0) if pad is not None else shifted
    weighted_N = _all_reduce_sum((exp * safe_shifted).sum(dim=-1), shard.group)
    entropy_N = log_z_N - weighted_N / sum_exp_N
    return logp_N, entropy_N


def token_logprobs_and_entropy(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    shard: VocabShard,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_tokens: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / T)[target]`` and the entropy of that distribution, per token.

    Differentiable through both outputs. Every TP rank must call this with the same token chunks
    (the collectives are per chunk).
    """
    batch, seq = targets_BT.shape
    flat_logits = logits_BTV.reshape(batch * seq, -1)
    flat_targets = targets_BT.reshape(-1)
    checkpointed = torch.is_grad_enabled() and logits_BTV.requires_grad
    logps, entropies = [], []
    # split (not slicing): its backward concatenates the chunk gradients once, where each
    # slice's backward would build a zero-filled full-size gradient per chunk
    for logits_chunk, targets_chunk in zip(
        flat_logits.split(chunk_tokens), flat_targets.split(chunk_tokens), strict=True
    ):
        args = (logits_chunk, targets_chunk, shard, temperature, with_entropy)
        if checkpointed:
            from torch.utils.checkpoint import checkpoint

            logp, ent = checkpoint(
                _chunk_logprobs_entropy, *args, use_reentrant=False, preserve_rng_state=False
            )
        else:
            logp, ent = _chunk_logprobs_entropy(*args)
        logps.append(logp)
        entropies.append(ent)
    logp_BT = torch.cat(logps).reshape(batch, seq)
    entropy_BT = torch.cat(entropies).reshape(batch, seq) if with_entropy else None
    return logp_BT, entropy_BT

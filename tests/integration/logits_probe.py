"""Full-vocabulary logits out of a Megatron actor, for equivalence tests against transformers.

Importable by spawned workers (pytest puts this folder on ``sys.path`` and spawned processes
inherit it). Runs the actor's own pipeline schedule (interleaved with virtual pipeline chunks)
one sequence per micro-batch and all-gathers the vocab-parallel shards on the last stage.
"""

from __future__ import annotations

import torch


def probe_batch(ids: torch.Tensor, prompt_len: int = 4):
    """A RolloutBatch holding ``ids`` (one row per sequence) with dummy rollout fields."""
    from megarl.batch import RolloutBatch

    num = ids.shape[0]
    return RolloutBatch(
        tokens=tuple(ids),
        prompt_lens=(prompt_len,) * num,
        group_ids=torch.zeros(num),
        rewards=torch.zeros(num),
        advantages=torch.zeros(num),
        engine_logprobs=tuple(torch.zeros(ids.shape[1] - prompt_len) for _ in range(num)),
    )


def full_logits(actor, batch, tp: int, vocab_size: int | None = None) -> torch.Tensor | None:
    """Logits ``[num_seqs, seq_len, vocab]`` on the last pipeline stage; None elsewhere."""
    from megatron.core import parallel_state as ps

    from megarl.batch import collate

    # sequence-parallel models take lengths that divide by actor.tp: cut the padding off after
    mbs = [
        collate(batch, [i], pad_id=0, length_multiple=actor.length_multiple)
        for i in range(batch.num_seqs)
    ]
    length = max(len(t) for t in batch.tokens)

    def gather_logits(mb, logits):
        shards = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(
            shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group()
        )
        return logits.new_zeros(()), torch.tensor(1), {"logits": torch.cat(shards, -1)}

    with torch.no_grad():
        outs = actor._run_schedule(mbs, gather_logits, forward_only=True)
    if not actor.is_last_stage:
        return None
    logits = torch.cat([o["logits"] for o in outs])[:, :length]
    return logits if vocab_size is None else logits[..., :vocab_size]

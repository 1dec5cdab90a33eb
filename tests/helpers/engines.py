"""References for a rollout engine's logprobs: one plain forward of the same weights."""

from __future__ import annotations

import torch

from megarl.engines.base import Generation


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, generation: Generation, temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each response token, from one unpadded, uncached
    forward of prompt+response on the model's device (``T=0``, greedy, scores at 1); on CPU."""
    device = next(model.parameters()).device
    ids_T = torch.tensor(generation.prompt_ids + generation.response_ids, device=device)
    logits_TV = model(ids_T.unsqueeze(0)).logits[0].float()
    logprobs_TV = torch.log_softmax(logits_TV / (temperature or 1.0), dim=-1)
    num_prompt = len(generation.prompt_ids)
    response_T = ids_T[num_prompt:].unsqueeze(-1)
    return logprobs_TV[num_prompt - 1 : -1].gather(-1, response_T).squeeze(-1).cpu()


def mean_abs_logprob_diff(
    model: torch.nn.Module, generations: list[Generation], temperature: float = 1.0
) -> float:
    """Mean over all response tokens of |engine logprob - :func:`reference_logprobs`|."""
    diffs = [
        (reference_logprobs(model, g, temperature) - torch.tensor(g.response_logprobs)).abs()
        for g in generations
    ]
    return torch.cat(diffs).mean().item()

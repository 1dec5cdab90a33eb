"""On-policy distillation (OPD): the student samples, a teacher scores every sampled token.

The student minimises the per-token reverse KL ``KL(pi_s || pi_t)`` on its own samples. Its
single-sample estimate at a sampled token ``y_t`` is ``log pi_s(y_t) - log pi_t(y_t)``, and
the policy gradient of ``-KL`` takes the negative of that as the token's reward with no
baseline and no discounting (each token's term is its own: Agarwal et al.'s GKD, Thinking
Machines' "on-policy distillation"). So the advantage of a sampled token is

    A_t = -(log pi_s(y_t) - log pi_t(y_t)) + reward_coef * A_seq

with ``A_seq`` the task reward's outcome advantage of the token's sequence (``reward_coef=0``:
pure distillation). ``log pi_s`` are the step's old (proximal) logprobs, the ones the PPO ratio
is taken against, so the advantage and the ratio agree on which policy sampled.

Only sampled tokens (mask 1) are scored: an agent loop's tool results and user turns are in the
response but were not sampled, so they get advantage 0 and train nothing. Pure: plain tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def distill_token_advantages(
    student_logp_BT: Tensor,
    teacher_logp_BT: Tensor,
    seq_advantages_B: Tensor,
    mask_BT: Tensor,
    reward_coef: float,
) -> Tensor:
    """Per-token advantages ``-(log pi_s - log pi_t) + reward_coef * A_seq`` on mask-1 tokens,
    exactly 0 elsewhere (padding, observation tokens).

    With the teacher equal to the student and ``reward_coef=0`` every token's advantage is
    exactly 0, so the step trains nothing: the exactness the tests hold.
    """
    if student_logp_BT.shape != teacher_logp_BT.shape or student_logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"student {tuple(student_logp_BT.shape)}, teacher {tuple(teacher_logp_BT.shape)} and "
            f"mask {tuple(mask_BT.shape)} logprobs must have one shape"
        )
    reverse_kl_BT = student_logp_BT.double() - teacher_logp_BT.double()
    advantages_BT = -reverse_kl_BT
    if reward_coef != 0:  # 0 * A_seq is 0 too, but never nan from an inf advantage
        advantages_BT = advantages_BT + reward_coef * seq_advantages_B.double().unsqueeze(-1)
    on = mask_BT != 0
    return torch.where(on, advantages_BT, torch.zeros_like(advantages_BT))


def reverse_kl_mean(student_logp_BT: Tensor, teacher_logp_BT: Tensor, mask_BT: Tensor) -> float:
    """``distill/reverse_kl/mean``: the mean over mask-1 tokens of ``log pi_s - log pi_t``
    (0 with no such token). Its expectation under the student's sampling is the reverse KL."""
    on = mask_BT != 0
    if not bool(on.any()):
        return 0.0
    diff = student_logp_BT.double() - teacher_logp_BT.double()
    return float(diff[on].mean())


def sequence_summaries(
    advantages_BT: Tensor, mask_BT: Tensor, dtype: torch.dtype = torch.float64
) -> Tensor:
    """One number per sequence for the planner: the token mean of its mask-1 advantages, or,
    where that mean is 0 although a token's advantage is not, that token's (the largest in
    magnitude).

    The planner prunes a sequence whose summary is exactly 0 (it trains nothing), so the
    summary must be 0 only when every trained token's advantage is: a plain mean can cancel
    to 0 and would drop a sequence that still has a gradient.
    """
    on = mask_BT != 0
    masked = torch.where(on, advantages_BT, torch.zeros_like(advantages_BT))
    counts = on.sum(dim=-1).clamp(min=1)
    means = masked.sum(dim=-1) / counts
    largest = masked.gather(-1, masked.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    summaries = torch.where(means != 0, means, largest)
    cast = summaries.to(dtype)
    tiny = torch.sign(summaries).to(dtype) * torch.finfo(dtype).tiny
    return torch.where((cast == 0) & (summaries != 0), tiny, cast)


def tokenizer_mismatch(student_vocab: Mapping[str, int], teacher_vocab: Mapping[str, int]) -> str:
    """Why the teacher's tokenizer cannot score the student's token ids ("" when it can).

    The teacher reads the student's sampled ids as they are, so both vocabularies must map
    every token string to the same id (cross-tokenizer distillation is another method)."""
    if len(student_vocab) != len(teacher_vocab):
        return f"{len(teacher_vocab)} tokens vs the model's {len(student_vocab)}"
    differ = [tok for tok, i in student_vocab.items() if teacher_vocab.get(tok) != i]
    if differ:
        return f"{len(differ)} tokens have other ids (e.g. {differ[0]!r})"
    return ""

"""Token sampling every engine that owns its decode loop shares: the seed contract and the
reported logprob, in one place.

An engine that runs its own loop (the ``transformers`` engine, the trainer's own Megatron model)
hands each step's next-token logits here and gets back one token per row; vLLM samples inside
its own processes and only keeps the contract's seeds (:func:`~megarl.engines.base.token_seed`).

The contract (see :mod:`megarl.engines.base`):

* **Seeds.** Response token ``j`` of a request is drawn by inverting its distribution's CDF at a
  uniform from a ``torch.Generator`` seeded ``token_seed(request.seed, j)``, never from torch's
  global RNG nor from a stream the batch shares. A request's tokens therefore do not depend on
  which requests share its call, and a response interrupted after ``n`` tokens and resumed (its
  tokens so far as ``Request.generated_ids``) draws token ``n`` from the same seed as an
  uninterrupted call would.
* **Logprob.** The reported value is ``log_softmax(logits / temperature)[token]`` of the
  untruncated distribution (temperature 1 when greedy), read before top-p: top-p changes which
  token may be drawn, never the value the trainer compares with its own forward.
* **Stop.** A response ends on any of the engine's EOS ids (kept, as its last token) or when it
  has used its budget (``Request.budget``); one that has not ended when the call stops was
  interrupted.

Nothing here knows a model: it sees logits, requests and generators only.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

import torch

from megarl.engines.base import (
    Generation,
    NonFiniteLogitsError,
    Request,
    SamplingParams,
    token_seed,
)


def top_p_filter(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the nucleus; the most likely token always survives.

    A token is kept when the mass of strictly more likely tokens is still below ``top_p``.
    The result is unnormalised, which :func:`invert_cdf` accepts.
    """
    if top_p >= 1.0:
        return probs_BV
    sorted_probs_BV, sorted_ids_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
    mass_before_BV = sorted_probs_BV.cumsum(dim=-1) - sorted_probs_BV
    sorted_probs_BV = sorted_probs_BV.masked_fill(mass_before_BV >= top_p, 0.0)
    return torch.zeros_like(probs_BV).scatter(-1, sorted_ids_BV, sorted_probs_BV)


def invert_cdf(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """Row ``b``'s token: the first whose cumulative mass exceeds ``uniform_B[b]`` (in [0, 1))
    times the row's total mass, so the row is drawn by its own uniform alone.

    Accumulated in float64: a ``uniform < 1`` then scales the total to strictly less than the
    total, and a token of probability zero (top-p's tail) adds no mass, so it is never the
    first to exceed the threshold."""
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    threshold_B1 = uniform_B.to(cdf_BV.device).unsqueeze(-1) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, threshold_B1, right=True).squeeze(-1)


def reported_logprobs(logits_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution whose value at the sampled token an engine reports:
    ``log_softmax(logits / temperature)``, temperature 1 when greedy, before any top-p."""
    if params.greedy:
        return torch.log_softmax(logits_BV, dim=-1)
    return torch.log_softmax(logits_BV / params.temperature, dim=-1)


def sample_next_tokens(
    logits_BV: torch.Tensor, params: SamplingParams, uniform_B: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (token_B, logprob_B) with the interface's logprob.

    ``uniform_B`` holds each row's own U[0, 1) draw (float64; None exactly when greedy), so a
    row's token depends on its logits and its uniform, never on the other rows."""
    logits_BV = logits_BV.float()
    if not bool(torch.isfinite(logits_BV).all()):
        bad = int((~torch.isfinite(logits_BV)).any(dim=-1).sum())
        raise NonFiniteLogitsError(f"the model's next-token logits are not finite in {bad} rows")
    logprobs_BV = reported_logprobs(logits_BV, params)
    if params.greedy:
        token_B = logits_BV.argmax(dim=-1)
    else:
        if uniform_B is None:
            raise ValueError("sampling at a temperature needs one uniform draw per row")
        token_B = invert_cdf(top_p_filter(logprobs_BV.exp(), params.top_p), uniform_B)
    logprob_B = logprobs_BV.gather(-1, token_B.unsqueeze(-1)).squeeze(-1)
    return token_B, logprob_B


@dataclass
class ResponseState:
    """What one ``generate_requests`` call has sampled so far for one request, token by token."""

    request: Request
    budget: int
    """New tokens it may sample in this call."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    """It sampled an EOS token."""

    @classmethod
    def start(cls, request: Request, params: SamplingParams) -> ResponseState:
        """Nothing sampled yet; the budget is what the request has left under ``params``."""
        return cls(request, request.budget(params))

    @property
    def ended(self) -> bool:
        """Stopped on EOS or its budget; a response that has not ended was interrupted."""
        return self.finished or len(self.tokens) == self.budget

    def next_uniform(self, generator: torch.Generator) -> float:
        """The U[0, 1) draw of the next token: ``generator`` re-seeded from the request's seed
        and the token's position in the whole response (tokens of earlier calls included)."""
        position = len(self.request.generated_ids) + len(self.tokens)
        generator.manual_seed(token_seed(self.request.seed, position))
        return torch.rand((), generator=generator, dtype=torch.float64).item()

    def append(self, token: int, logprob: float, is_eos: bool) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.finished = is_eos

    def generation(
        self,
        routed_experts: torch.Tensor | None = None,
        prompt_routed_experts: torch.Tensor | None = None,
    ) -> Generation:
        """The result: this call's tokens under the request's own prompt, interrupted when it
        has not ended (routing as :class:`~megarl.engines.base.Generation` defines it)."""
        return Generation(
            tuple(self.request.prompt_ids),
            tuple(self.tokens),
            tuple(self.logprobs),
            self.finished,
            routed_experts,
            prompt_routed_experts,
            interrupted=not self.ended,
        )


def sample_step(
    responses: Sequence[ResponseState],
    logits_BV: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    eos_token_ids: Container[int],
    logprobs_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sample the next token of every response (one per row of ``logits_BV``, none of them
    ended) and record it; return the ``[B]`` tokens to feed next.

    ``generator`` lives on the host whatever the device: it is re-seeded before each row's
    draw, so one serves all rows. ``logprobs_of``: the sampled tokens' ``[B]`` logprobs from
    another computation of the same distribution (the Megatron engine's batch-invariant mode
    takes the trainer's), recorded instead of the sampling distribution's."""
    uniform_B = None
    if not params.greedy:
        uniform_B = torch.tensor(
            [response.next_uniform(generator) for response in responses], dtype=torch.float64
        )
    token_B, logprob_B = sample_next_tokens(logits_BV, params, uniform_B)
    if logprobs_of is not None:
        logprob_B = logprobs_of(token_B)
    for response, token, logprob in zip(
        responses, token_B.tolist(), logprob_B.tolist(), strict=True
    ):
        response.append(token, logprob, token in eos_token_ids)
    return token_B

"""The sampling every engine that owns its decode loop shares, on plain logits: the seed
contract (a row's draw is its own) and the bookkeeping of a response token by token."""

from __future__ import annotations

import torch

from megarl.engines.base import Request, SamplingParams
from megarl.engines.sampling import ResponseState, reported_logprobs, sample_step

EOS = 2


def _step(requests: list[Request], logits_BV: torch.Tensor, params: SamplingParams):
    states = [ResponseState.start(request, params) for request in requests]
    sample_step(states, logits_BV, params, torch.Generator(), (EOS,))
    return states


def test_a_rows_token_and_logprob_do_not_depend_on_the_rest_of_its_batch():
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=4)
    logits_BV = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    requests = [Request((1, 2), seed=100 + i) for i in range(5)]
    together = _step(requests, logits_BV, params)
    for row, request in enumerate(requests):
        [alone] = _step([request], logits_BV[row : row + 1], params)
        assert (alone.tokens, alone.logprobs) == (together[row].tokens, together[row].logprobs)
    assert len({state.tokens[0] for state in together}) > 1  # different seeds, different draws


def test_a_resumed_response_draws_its_next_token_from_the_same_seed():
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    logits_BV = torch.zeros(1, 1000)  # uniform: the token is the draw itself
    fresh = ResponseState.start(Request((1,), seed=7), params)
    generator = torch.Generator()
    for _ in range(3):
        sample_step([fresh], logits_BV, params, generator, (EOS,))
    resumed = _step(
        [Request((1,), seed=7, generated_ids=tuple(fresh.tokens[:2]))], logits_BV, params
    )
    assert resumed[0].tokens == fresh.tokens[2:3]


def test_the_reported_logprob_is_the_untruncated_tempered_distributions():
    params = SamplingParams(temperature=0.5, top_p=0.1, max_new_tokens=2)
    logits_BV = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    [state] = _step([Request((1,), seed=3)], logits_BV, params)
    expected = torch.log_softmax(logits_BV / 0.5, dim=-1)[0, state.tokens[0]].item()
    assert state.logprobs == [expected]
    assert state.tokens == [0]  # top_p=0.1 keeps only the most likely token
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(reported_logprobs(logits_BV, greedy), torch.log_softmax(logits_BV, -1))


def test_a_response_ends_on_eos_or_its_budget_and_is_interrupted_otherwise():
    params = SamplingParams(temperature=0.0, max_new_tokens=2)
    to_eos = torch.zeros(1, 8)
    to_eos[0, EOS] = 5.0
    [stopped] = _step([Request((1,), seed=0)], to_eos, params)
    assert stopped.finished and stopped.ended and stopped.generation().finished
    [going] = _step([Request((1,), seed=0)], torch.arange(8.0).unsqueeze(0), params)
    assert not going.ended and going.generation().interrupted
    sample_step([going], torch.arange(8.0).unsqueeze(0), params, torch.Generator(), (EOS,))
    generation = going.generation()
    assert going.ended and not generation.interrupted and not generation.finished
    assert generation.response_ids == (7, 7)


def test_another_computations_logprobs_are_recorded_for_the_same_tokens():
    """The Megatron engine's batch-invariant mode records the trainer's logprobs of the tokens
    the distribution drew; the draws themselves do not change."""
    params = SamplingParams(temperature=0.7, max_new_tokens=4)
    logits_BV = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    requests = [Request((1, 2), seed=5 + i) for i in range(3)]
    plain = _step(requests, logits_BV, params)
    states = [ResponseState.start(request, params) for request in requests]
    seen = []

    def trainer_logprobs(token_B: torch.Tensor) -> torch.Tensor:
        seen.append(token_B.tolist())
        return -token_B.double() / 1000

    sample_step(states, logits_BV, params, torch.Generator(), (EOS,), trainer_logprobs)
    assert [s.tokens for s in states] == [p.tokens for p in plain]
    assert seen == [[p.tokens[0] for p in plain]]
    assert [s.logprobs for s in states] == [[-p.tokens[0] / 1000] for p in plain]

"""generate_requests of every in-process engine (HF, Megatron): per-request seeds, budgets,
interruption and resumption. The engine-contract tests take the ``make`` fixture and run once per
engine; the ones about the HF engine's own loop (its forwards, MoE routing) build it directly.

What the asynchronous rollout relies on: a request's tokens depend on its own seed only (not on
the batch it shares a call with), and a response interrupted after any number of tokens, then
resumed from its tokens so far, is the response an uninterrupted call samples.

Logprobs across batch compositions, and across an interruption (a prefill of prompt + tokens so
far instead of cached decode steps), are not bitwise equal on CPU: the GEMMs run on other
shapes. Measured on the tiny Llama below (30 sampling setups, tied and untied), the largest
difference is 4.8e-7 across batches and 7.2e-7 across interruptions, about one float32 ulp of
logprobs of this size; :data:`LOGPROB_ATOL` leaves room for other BLAS builds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import pytest
import torch

pytest.importorskip("transformers")
from helpers.engines import (
    InterruptAfter,
    megatron_engine,
    megatron_world,
    sample_with_interruptions,
)
from helpers.models import MOE_EXPERTS
from test_engine_hf import (
    EOS,
    PROMPTS,
    VOCAB,
    bias_eos,
    greedy,
    make_engine,
    reference_input_routing,
    tiny_llama,
    tiny_moe,
)

from megarl.engines.base import Generation, Request, RolloutEngine, SamplingParams, request_seed

LOGPROB_ATOL = 5e-6
ENGINES = ("hf", "megatron")


@pytest.fixture(scope="module")
def _megatron():
    with megatron_world():
        yield


@pytest.fixture(params=ENGINES)
def make(request):
    """Builds the engine under test from a tiny HF Llama, ``eos_bias`` added to its EOS logit
    (the Megatron engine: the same weights in a Megatron model, in a world of one)."""
    if request.param == "hf":

        def build_hf(model, eos_bias: float | None = None) -> RolloutEngine:
            if eos_bias is not None:
                bias_eos(model, eos_bias)
            return make_engine(model)

        return build_hf
    request.getfixturevalue("_megatron")
    return lambda model, eos_bias=None: megatron_engine(model, EOS, 0, eos_bias)


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)


def requests_for(prompts: Sequence[Sequence[int]], seed: int = 11) -> list[Request]:
    return [Request(tuple(p), request_seed(seed, i)) for i, p in enumerate(prompts)]


def assert_same_responses(got: Sequence[Generation], expected: Sequence[Generation]) -> None:
    """Same tokens and stopping; logprobs equal up to :data:`LOGPROB_ATOL`."""
    assert [g.response_ids for g in got] == [g.response_ids for g in expected]
    assert [g.finished for g in got] == [g.finished for g in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs),
            torch.tensor(b.response_logprobs),
            atol=LOGPROB_ATOL,
            rtol=0,
        )


# --- batch independence -----------------------------------------------------------------------


def test_a_request_samples_the_same_in_any_batch(make):
    engine = make(tiny_llama(), 2.0)  # rows end at different steps: batches shrink differently
    requests = requests_for(PROMPTS * 3)
    together = engine.generate_requests(requests, SAMPLED)
    assert len({g.response_ids for g in together}) == len(requests)
    assert any(g.finished for g in together) and not all(g.finished for g in together)

    reversed_order = engine.generate_requests(requests[::-1], SAMPLED)[::-1]
    assert_same_responses(reversed_order, together)
    evens = engine.generate_requests(requests[::2], SAMPLED)
    odds = engine.generate_requests(requests[1::2] + requests[:1], SAMPLED)[:-1]
    assert_same_responses([g for pair in zip(evens, odds, strict=True) for g in pair], together)
    alone = [engine.generate_requests([r], SAMPLED)[0] for r in requests]
    assert_same_responses(alone, together)


def test_each_distinct_context_is_prefilled_once_and_ended_rows_leave_the_batch():
    """The work the loop skips: ``n`` samples of one prompt share one prefill row, and a decode
    step runs only the rows still going after the step before it."""
    model = tiny_llama()
    bias_eos(model, 2.0)
    rows_per_forward: list[int] = []
    model.register_forward_hook(
        lambda _m, _a, kwargs, _out: rows_per_forward.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    engine = make_engine(model)
    prompts = [p for p in PROMPTS[:3] for _ in range(4)]
    requests = [*requests_for(prompts), Request(tuple(PROMPTS[0]), 99, (30, 31))]
    generations = engine.generate_requests(requests, SAMPLED)

    # three prompts, and one resumed response whose context (prompt + its tokens) is its own
    assert rows_per_forward[0] == 4
    lengths = [len(g.response_ids) for g in generations]
    budgets = [r.budget(SAMPLED) for r in requests]
    going_after = [sum(length > step for length in lengths) for step in range(1, max(lengths))]
    assert rows_per_forward[1:] == going_after
    assert going_after[0] < len(requests) and going_after[-1] < going_after[0]
    assert all(g.finished or n == b for g, n, b in zip(generations, lengths, budgets, strict=True))


def test_a_request_with_its_own_limit_stops_there_and_samples_what_it_would_alone():
    """Requests of one call may carry their own ``max_new_tokens``: each stops at it (its row
    leaves the batch) with the tokens and logprobs a call at that limit gives it."""
    model = tiny_llama()
    rows_per_forward: list[int] = []
    model.register_forward_hook(
        lambda _m, _a, kwargs, _out: rows_per_forward.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    engine = make_engine(model)
    limits = [2, 5, None]
    base = [*requests_for(PROMPTS[:3])]
    requests = [dataclasses.replace(r, max_new_tokens=k) for r, k in zip(base, limits, strict=True)]
    together = engine.generate_requests(requests, SAMPLED)  # SAMPLED: 12 new tokens
    assert [len(g.response_ids) for g in together if not g.finished] == [
        k or SAMPLED.max_new_tokens for k, g in zip(limits, together, strict=True) if not g.finished
    ]
    assert rows_per_forward[1:3] == [3, 2] and rows_per_forward[5] == 1  # rows leave at 2 and 5
    alone = [
        engine.generate_requests(
            [r], dataclasses.replace(SAMPLED, max_new_tokens=k or SAMPLED.max_new_tokens)
        )[0]
        for r, k in zip(base, limits, strict=True)
    ]
    assert_same_responses(together, alone)


def test_generate_seeds_prompt_i_with_request_seed(make):
    engine = make(tiny_llama())
    params = SamplingParams(max_new_tokens=8, seed=5)
    expected = engine.generate_requests(requests_for(PROMPTS, seed=5), params)
    assert engine.generate(PROMPTS, params) == expected
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=6)) != expected


# --- interruption -----------------------------------------------------------------------------


@pytest.mark.parametrize("polls", [1, 3, 5])
@pytest.mark.parametrize(
    "params",
    [SAMPLED, SamplingParams(temperature=1.3, max_new_tokens=12), greedy(12)],
    ids=["t0.8-p0.9", "t1.3", "greedy"],
)
def test_interrupted_and_resumed_responses_equal_uninterrupted_ones(make, params, polls):
    engine = make(tiny_llama(), 0.0 if params.greedy else 2.0)
    requests = requests_for(PROMPTS * 3, seed=14)
    uninterrupted = engine.generate_requests(requests, params)
    assert not any(g.interrupted for g in uninterrupted)
    assert polls < max(len(g.response_ids) for g in uninterrupted) == params.max_new_tokens
    if not params.greedy:  # responses that stop on EOS before and after an interruption
        eos_lengths = [len(g.response_ids) for g in uninterrupted if g.finished]
        assert min(eos_lengths) <= polls < max(eos_lengths)

    joined, pieces = sample_with_interruptions(engine, requests, params, polls)
    assert_same_responses(joined, uninterrupted)
    for parts in pieces:
        assert all(p.interrupted and len(p.response_ids) == polls for p in parts[:-1])
        assert not parts[-1].interrupted
        assert all(not p.finished for p in parts[:-1])
    interruptions = [len(parts) - 1 for parts in pieces]
    assert max(interruptions) == -(-params.max_new_tokens // polls) - 1  # ceil: the longest
    assert max(interruptions) >= 2  # some responses were resumed and interrupted again


def test_a_set_interrupt_still_samples_one_token_per_request(make):
    engine = make(tiny_llama(), 3.0)  # some rows stop on their first token
    requests = requests_for(PROMPTS * 3)
    interrupt = threading.Event()
    interrupt.set()
    first_tokens = engine.generate_requests(requests, SAMPLED, interrupt)
    uninterrupted = engine.generate_requests(requests, SAMPLED)
    for got, full in zip(first_tokens, uninterrupted, strict=True):
        assert got.response_ids == full.response_ids[:1]
        assert got.finished == (full.response_ids[0] == EOS)
        assert got.interrupted == (not got.finished)
    assert any(g.finished for g in first_tokens) and any(g.interrupted for g in first_tokens)
    # a call that ends every response by its budget reports none interrupted
    one_token = SamplingParams(temperature=0.8, max_new_tokens=1)
    assert not any(g.interrupted for g in engine.generate_requests(requests, one_token, interrupt))


# --- budgets ----------------------------------------------------------------------------------


def test_resumed_requests_sample_only_their_budget(make):
    engine = make(tiny_llama(), -1e4)
    so_far = (30, 31, 32, 33, 34, 35, 36, 37, 38)
    requests = [
        Request((5, 6, 7), 1),
        Request((5, 6, 7), 2, so_far[:3]),
        Request((12, 13), 3, so_far),
    ]
    generations = engine.generate_requests(requests, SamplingParams(max_new_tokens=10))
    assert [len(g.response_ids) for g in generations] == [10, 7, 1]
    assert not any(g.finished or g.interrupted for g in generations)
    assert [g.prompt_ids for g in generations] == [r.prompt_ids for r in requests]


def test_requests_that_cannot_go_on_are_refused(make):
    engine = make(tiny_llama())
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="request 1 has no budget left: 4 tokens"):
        engine.generate_requests([Request((5,), 1), Request((5,), 2, (6, 7, 8, 9))], params)
    with pytest.raises(ValueError, match="request 0 already ended"):
        engine.generate_requests([Request((5,), 1, (6, EOS))], params)
    with pytest.raises(ValueError, match="request 0 has token ids outside"):
        engine.generate_requests([Request((5,), 1, (VOCAB,))], params)
    with pytest.raises(ValueError, match="request 0 has an empty prompt"):
        engine.generate_requests([Request((), 1, (6,))], params)
    assert engine.generate_requests([], params) == []


# --- RNG --------------------------------------------------------------------------------------


def test_generate_requests_does_not_touch_the_global_rng(make):
    engine = make(tiny_llama())
    requests = [*requests_for(PROMPTS), Request((5, 6), 3, (7, 8))]
    state = torch.get_rng_state()
    engine.generate_requests(requests, SAMPLED, InterruptAfter(2))
    assert torch.equal(torch.get_rng_state(), state)


# --- mixture-of-experts routing ---------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_resumed_moe_responses_route_like_one_full_forward(family):
    """Joined pieces carry the routing of every input position once: the first piece's prompt
    routing, then each piece's response routing; resumed pieces bring no prompt routing."""
    model = tiny_moe(family)
    engine = make_engine(model)
    requests = requests_for(PROMPTS)
    joined, pieces = sample_with_interruptions(
        engine, requests, SamplingParams(max_new_tokens=7), 3
    )
    assert max(len(parts) for parts in pieces) == 3  # 3 + 3 + 1 tokens, or EOS before
    for generation, parts in zip(joined, pieces, strict=True):
        assert all(p.prompt_routed_experts is None for p in parts[1:])
        assert all(p.routed_experts is not None for p in parts)
        assert generation.prompt_routed_experts is not None
        assert generation.routed_experts is not None
        full = torch.cat([generation.prompt_routed_experts, generation.routed_experts])
        expected = reference_input_routing(model, generation)
        assert torch.equal(full.long().sort(-1).values, expected.sort(-1).values)

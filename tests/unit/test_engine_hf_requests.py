"""The HF engine's own decode loop under ``generate_requests``: the forwards it runs (one
prefill row per distinct context, ended rows leaving the batch, per-request limits) and the
routing it reports for mixture-of-experts models across interruptions. The engine contract
itself (seeds, batches, interruption and resumption, budgets, refusals) runs against every
engine from :mod:`helpers.engine_contract` (``test_engine_contract.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from helpers.engine_contract import assert_same_responses, requests_for
from helpers.engines import InterruptAfter, sample_with_interruptions
from helpers.models import MOE_EXPERTS
from test_engine_hf import (
    PROMPTS,
    bias_eos,
    make_engine,
    reference_input_routing,
    tiny_llama,
    tiny_moe,
)

from megarl.engines.base import Request, SamplingParams

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)


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


@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_resumed_moe_responses_route_like_one_full_forward(family):
    """Joined pieces carry the routing of every input position once: the first piece's prompt
    routing, then each piece's response routing; resumed pieces bring no prompt routing."""
    model = tiny_moe(family)
    engine = make_engine(model)  # pyright: ignore[reportArgumentType] - any causal LM
    requests = requests_for(PROMPTS)
    joined, pieces = sample_with_interruptions(
        engine, requests, SamplingParams(max_new_tokens=7), lambda: InterruptAfter(3)
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

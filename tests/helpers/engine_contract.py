"""The rollout-engine contract (:mod:`megarl.engines.base`) as test functions every engine runs.

A thin module per test tier binds the engines: ``tests/unit/test_engine_contract.py`` the HF and
Megatron engines (in process, milliseconds to build), ``tests/integration/
test_engine_contract_vllm.py`` the vLLM engine (a process of its own, started once per module).
Each defines a ``contract`` fixture giving an :class:`EngineUnderTest` and a ``Test*`` subclass of
:class:`EngineContract`, whose tests pytest then collects there.

What every engine promises, and what the tests here check:

* a request's tokens depend on its own seed and context only, not on the batch it shares a call
  with; ``generate`` seeds prompt ``i`` ``request_seed(params.seed, i)``; copies of a prompt
  (a group's ``n`` samples) differ;
* logprobs are ``log_softmax(logits / T)[token]`` of the model's distribution (a teacher-forced
  forward of the same weights gives them), greedy at ``T = 1``; a response ends on EOS
  (``finished``) or at its budget;
* an interrupted response comes back with its tokens so far, and a :class:`Request` carrying
  them (``generated_ids``) goes on as a fresh request with those ``generated_ids`` does: a
  resumed response reads the right context and samples only its budget;
* an interrupt never set changes nothing; the global torch RNG is untouched; requests no engine
  can continue are refused with the same one-line messages.

Where the engines differ, :class:`EngineUnderTest` says how, and the tests check each engine's
own promise rather than skip:

* **One random stream per response, or one per call.** The HF and Megatron engines draw token
  ``j`` of a response from ``token_seed(seed, j)`` alone, so a response interrupted and
  resumed is token for token the uninterrupted one. vLLM's per-request generator is stateful
  and lives in its engine core; a resumed request is seeded ``token_seed(seed, tokens so far)``
  (:mod:`megarl.engines.vllm`), so its sampled continuation is reproducible but another draw
  than the uninterrupted one. Greedy responses are the same on every engine.
* **Tokens per poll.** Every engine samples a first token for each request before it looks at
  the interrupt (so a response advances however early its calls are interrupted). The HF and
  Megatron engines run their decode loop in the caller's thread: after that, every request
  still going samples exactly one token between two polls. vLLM's engine core steps in a
  process of its own and the caller reads one step's outputs per poll, with some lag (a request
  added while a step ran joins the next one), so an interrupted piece holds at least one token,
  about one per poll.
* **Which temperatures and top-p a vLLM engine reports.** vLLM reports the logprob the
  contract defines either raw (T = 1, any top-p) or processed (any T, top-p 1: it renormalises
  after top-p); the vLLM binding runs processed, so its sampled setting is T = 0.8 without
  top-p (the HF and Megatron engines: T = 0.8, top-p 0.9). Its refusal of the other
  combinations is tested in ``test_vllm_engine.py``.
* **The EOS bias.** The tests shape how often responses end with a bias added to the EOS logit:
  a forward hook on the HF model's ``lm_head`` and on the Megatron model's output layer, and
  for vLLM, whose model runs in another process, a ``logit_bias`` on every request (applied
  before the processed logprobs, so they include it, as the hooks' logprobs do).

The model is a two-layer Llama with head size 32 (vLLM's CPU attention refuses 16). Logprobs
across batch compositions and interruptions are not bitwise equal on CPU (the GEMMs run on other
shapes): measured on this model, the largest difference is ~1e-6 (HF, Megatron, vLLM);
:data:`LOGPROB_ATOL` leaves room for other BLAS builds.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from helpers.engines import (
    InterruptAfter,
    reference_logprobs,
    sample_with_interruptions,
)
from helpers.models import engine_llama
from megarl.engines.base import (
    Generation,
    Request,
    RolloutEngine,
    SamplingParams,
    request_seed,
)

VOCAB = 128
EOS = 2
PAD = 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]]
LOGPROB_ATOL = 5e-6
REFERENCE_ATOL = 1e-4
"""Engine logprobs against a teacher-forced HF forward of the same weights: another program
(Megatron's layers, vLLM's kernels) on the same fp32 numbers; measured up to ~2e-6."""


def contract_model():
    """The model every engine of the contract serves: a two-layer Llama, head size 32, untied."""
    return engine_llama(
        0, VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, pad_token_id=PAD
    )


def bias_eos(model: torch.nn.Module, bias: float) -> torch.nn.Module:
    """Add ``bias`` to ``model``'s EOS logit (a forward hook on its ``lm_head``); returns it."""
    bias_V = torch.zeros(VOCAB)
    bias_V[EOS] = bias
    model.lm_head.register_forward_hook(lambda _m, _i, out: out + bias_V.to(out.device))  # pyright: ignore[reportAttributeAccessIssue]
    return model


def reference_model(eos_bias: float | None = None) -> torch.nn.Module:
    """The contract model as HF computes it, with the EOS bias an engine was built with."""
    model = contract_model()
    return bias_eos(model, eos_bias) if eos_bias is not None else model


@dataclass(frozen=True)
class EngineUnderTest:
    """An engine bound to the contract, and how its promises differ (see the module docstring)."""

    name: str
    build: Callable[[float | None], RolloutEngine]
    """The engine serving :func:`contract_model`, with this EOS bias (None: none)."""
    sampled: SamplingParams
    """The tempered, possibly top-p, sampling this engine reports logprobs for."""
    resumes_the_same_stream: bool
    """Whether a sampled response interrupted and resumed is the uninterrupted one."""
    lockstep: bool
    """Whether every request samples exactly one token before the first poll and one between
    two polls (else: at least one before the first, about one per poll)."""

    def make(self, eos_bias: float | None = None) -> RolloutEngine:
        return self.build(eos_bias)

    def interrupt_after(self, tokens: int) -> InterruptAfter:
        """An interrupt that stops a call once the requests still going sampled ``tokens``
        tokens (exactly, on a lockstep engine): the first poll comes after the first token."""
        return InterruptAfter(tokens)


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


def assert_reference_logprobs(
    model: torch.nn.Module, generations: Sequence[Generation], temperature: float
) -> None:
    """Every response token's logprob is the teacher-forced forward's (up to
    :data:`REFERENCE_ATOL`): the engine read the right context and reports the defined value."""
    for generation in generations:
        torch.testing.assert_close(
            torch.tensor(generation.response_logprobs),
            reference_logprobs(model, generation, temperature),
            atol=REFERENCE_ATOL,
            rtol=0,
        )


SETTINGS = ("sampled", "t1.3", "greedy")
"""The sampling setups of the tests below: the engine's tempered one, a hot one, argmax."""


def setting(contract: EngineUnderTest, name: str) -> SamplingParams:
    return {
        "sampled": contract.sampled,
        "t1.3": SamplingParams(temperature=1.3, max_new_tokens=12),
        "greedy": SamplingParams(temperature=0.0, max_new_tokens=12),
    }[name]


class EngineContract:
    """The contract's tests. A binding module subclasses it as ``Test<Engine>Contract`` beside
    its ``contract`` fixture, and pytest collects the tests there."""

    # --- batch independence, seeds, the logprob definition ---------------------------------------

    def test_a_request_samples_the_same_in_any_batch(self, contract: EngineUnderTest):
        engine = contract.make(2.0)  # rows end at different steps: batches shrink differently
        params = contract.sampled
        requests = requests_for(PROMPTS * 3)
        together = engine.generate_requests(requests, params)
        assert len({g.response_ids for g in together}) == len(requests)
        assert any(g.finished for g in together) and not all(g.finished for g in together)

        reversed_order = engine.generate_requests(requests[::-1], params)[::-1]
        assert_same_responses(reversed_order, together)
        evens = engine.generate_requests(requests[::2], params)
        odds = engine.generate_requests(requests[1::2] + requests[:1], params)[:-1]
        assert_same_responses([g for pair in zip(evens, odds, strict=True) for g in pair], together)
        alone = [engine.generate_requests([r], params)[0] for r in requests]
        assert_same_responses(alone, together)

    def test_generate_seeds_prompt_i_with_request_seed(self, contract: EngineUnderTest):
        engine = contract.make()
        params = SamplingParams(max_new_tokens=8, seed=5)
        expected = engine.generate_requests(requests_for(PROMPTS, seed=5), params)
        assert engine.generate(PROMPTS, params) == expected
        assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=6)) != expected

    @pytest.mark.parametrize("name", SETTINGS)
    def test_logprobs_are_the_models_and_responses_stop_on_eos_or_budget(self, contract, name):
        """Four samples of each prompt (a group): they differ unless greedy; each ends on its first
        EOS or at the budget; every logprob is the teacher-forced forward's at the call's
        temperature (1 when greedy), before any top-p truncation."""
        params = setting(contract, name)
        eos_bias = 0.0 if params.greedy else 2.0  # greedy: with more, every response is EOS
        engine = contract.make(eos_bias)
        generations = engine.generate([p for p in PROMPTS for _ in range(4)], params)
        assert [g.prompt_ids for g in generations] == [tuple(p) for p in PROMPTS for _ in range(4)]
        for g in generations:
            assert EOS not in g.response_ids[:-1]
            assert g.finished == (g.response_ids[-1] == EOS)
            assert g.finished or len(g.response_ids) == params.max_new_tokens
        assert any(g.finished for g in generations) and not all(g.finished for g in generations)
        groups = [{g.response_ids for g in generations[i : i + 4]} for i in range(0, 16, 4)]
        assert all(len(group) == (1 if params.greedy else 4) for group in groups)
        assert_reference_logprobs(reference_model(eos_bias), generations, params.temperature)

    # --- interruption -----------------------------------------------------------------------------

    @pytest.mark.parametrize("polls", [1, 3, 5])
    @pytest.mark.parametrize("name", SETTINGS)
    def test_interrupted_and_resumed_responses_go_on_as_fresh_requests(self, contract, name, polls):
        """Every call interrupted after ``polls`` tokens, the interrupted responses resumed until
        none is left. On every engine each piece is what a fresh request with the tokens before it
        as ``generated_ids`` samples, and the joined response's logprobs are the model's; where the
        engine keeps one random stream per response (and always when greedy) the joined response
        is the uninterrupted one."""
        params = setting(contract, name)
        eos_bias = 0.0 if params.greedy else 2.0
        engine = contract.make(eos_bias)
        requests = requests_for(PROMPTS * 3, seed=14)
        uninterrupted = engine.generate_requests(requests, params)
        assert not any(g.interrupted for g in uninterrupted)
        assert polls < max(len(g.response_ids) for g in uninterrupted) == params.max_new_tokens
        if not params.greedy:  # some responses stop on EOS in a resumed piece
            assert polls < max(len(g.response_ids) for g in uninterrupted if g.finished)

        def goes_on_as_fresh_requests(calls: list[Request], generations: list[Generation]) -> None:
            fresh = engine.generate_requests(calls, params)
            for piece, whole in zip(generations, fresh, strict=True):
                n = len(piece.response_ids)
                assert piece.response_ids == whole.response_ids[:n]
                torch.testing.assert_close(
                    torch.tensor(piece.response_logprobs),
                    torch.tensor(whole.response_logprobs[:n]),
                    atol=LOGPROB_ATOL,
                    rtol=0,
                )

        joined, pieces = sample_with_interruptions(
            engine,
            requests,
            params,
            lambda: contract.interrupt_after(polls),
            goes_on_as_fresh_requests,
        )
        for parts in pieces:
            assert all(p.interrupted and not p.finished for p in parts[:-1])
            assert not parts[-1].interrupted
            lengths = [len(p.response_ids) for p in parts[:-1]]
            assert all(n == polls if contract.lockstep else n >= 1 for n in lengths)
        for g in joined:
            assert g.finished == (g.response_ids[-1] == EOS)
            assert g.finished or len(g.response_ids) == params.max_new_tokens
        assert max(len(parts) for parts in pieces) >= 2  # resumed (lockstep: again, counted below)
        assert_reference_logprobs(reference_model(eos_bias), joined, params.temperature)
        if contract.lockstep:
            interruptions = [len(parts) - 1 for parts in pieces]
            assert max(interruptions) == -(-params.max_new_tokens // polls) - 1  # ceil: the longest
        if contract.resumes_the_same_stream or params.greedy:
            assert_same_responses(joined, uninterrupted)
        else:  # another draw after each interruption: the sampled responses go elsewhere
            assert [g.response_ids for g in joined] != [g.response_ids for g in uninterrupted]

    def test_a_set_interrupt_still_samples_a_first_token_per_request(self, contract):
        """An interrupt set before the call: each response holds the uninterrupted response's first
        token (a lockstep engine: only it; vLLM: possibly one or two more, sampled while the last
        requests got theirs); it is ``finished`` if it ended on EOS, else ``interrupted``."""
        engine = contract.make(3.0)  # some rows stop on their first token
        requests = requests_for(PROMPTS * 3)
        interrupt = threading.Event()
        interrupt.set()
        first_tokens = engine.generate_requests(requests, contract.sampled, interrupt)
        uninterrupted = engine.generate_requests(requests, contract.sampled)
        for got, full in zip(first_tokens, uninterrupted, strict=True):
            n = len(got.response_ids)
            assert n == 1 if contract.lockstep else 1 <= n < contract.sampled.max_new_tokens
            assert got.response_ids == full.response_ids[:n]
            assert got.finished == (got.response_ids[-1] == EOS)
            assert got.interrupted == (not got.finished)
        assert any(g.finished for g in first_tokens) and any(g.interrupted for g in first_tokens)
        # the engine still serves the uninterrupted responses afterwards
        assert_same_responses(engine.generate_requests(requests, contract.sampled), uninterrupted)
        # a call that ends every response by its budget reports none interrupted
        one_token = dataclasses.replace(contract.sampled, max_new_tokens=1)
        assert not any(
            g.interrupted for g in engine.generate_requests(requests, one_token, interrupt)
        )

    def test_an_interrupt_never_set_samples_what_a_call_without_one_samples(self, contract):
        engine = contract.make(2.0)
        fresh = requests_for(PROMPTS, seed=4)
        done = engine.generate_requests(fresh[1:2], contract.sampled)[0].response_ids
        batch = [*fresh, dataclasses.replace(fresh[1], generated_ids=done[:3])]
        stepped = engine.generate_requests(batch, contract.sampled, threading.Event())
        assert stepped == engine.generate_requests(batch, contract.sampled)  # logprobs included
        assert not any(g.interrupted for g in stepped)

    # --- budgets and refusals ---------------------------------------------------------------------

    def test_resumed_requests_sample_only_their_budget(self, contract: EngineUnderTest):
        engine = contract.make(-1e4)
        so_far = (30, 31, 32, 33, 34, 35, 36, 37, 38)
        requests = [
            Request((5, 6, 7), 1),
            Request((5, 6, 7), 2, so_far[:3]),
            Request((12, 13), 3, so_far),
            Request((12, 13), 4, so_far[:2], max_new_tokens=6),
        ]
        generations = engine.generate_requests(requests, SamplingParams(max_new_tokens=10))
        assert [len(g.response_ids) for g in generations] == [10, 7, 1, 4]
        assert not any(g.finished or g.interrupted for g in generations)
        assert [g.prompt_ids for g in generations] == [r.prompt_ids for r in requests]

    def test_requests_that_cannot_go_on_are_refused(self, contract: EngineUnderTest):
        engine = contract.make()
        params = SamplingParams(max_new_tokens=4)
        with pytest.raises(ValueError, match="request 1 has no budget left: 4 tokens"):
            engine.generate_requests([Request((5,), 1), Request((5,), 2, (6, 7, 8, 9))], params)
        with pytest.raises(ValueError, match="request 0 has no budget left: 0 tokens"):
            engine.generate_requests([Request((5,), 1, max_new_tokens=0)], params)
        with pytest.raises(ValueError, match="request 0 already ended"):
            engine.generate_requests([Request((5,), 1, (6, EOS))], params)
        with pytest.raises(ValueError, match=r"request 0 has token ids outside \[0, 128\)"):
            engine.generate_requests([Request((5,), 1, (VOCAB,))], params)
        with pytest.raises(ValueError, match="request 0 has an empty prompt"):
            engine.generate_requests([Request((), 1, (6,))], params)
        assert engine.generate_requests([], params) == []

    def test_generate_requests_does_not_touch_the_global_rng(self, contract: EngineUnderTest):
        engine = contract.make()
        requests = [*requests_for(PROMPTS), Request((5, 6), 3, (7, 8))]
        state = torch.get_rng_state()
        engine.generate_requests(requests, contract.sampled, contract.interrupt_after(2))
        assert torch.equal(torch.get_rng_state(), state)

"""Agent loops on the embedded HF engine: a multi-turn trajectory is what the trainer recomputes.

A tiny random Llama over SmolLM2's real vocabulary and tokenizer (the engine tests' tiny model,
sized to the tokenizer so that the interface's example runs as written, with
``ctx.tokenizer.encode``). Checked end to end: the example's masks, that every turn continues the
trajectory's ids exactly, that the engine's logprobs of both turns equal a teacher-forced fp32
forward of the whole trajectory (observation tokens included as context), that a trajectory does
not depend on the trajectories it was batched with, and that ``single_turn`` is bitwise the
plain ``engine.generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from helpers.agent_loops import OBSERVATION, TwoTurns

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM

from megarl.agent import Trajectory
from megarl.agent.driver import make_samples, run_agent_loops
from megarl.agent.loop import SingleTurnLoop
from megarl.engines.base import Generation, Request, SamplingParams
from megarl.engines.hf import HFEngine

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 12 + 7?", "Name a prime number.", "Say hello.", "What is 3 * 5?"]
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=5)


class RecordingEngine(HFEngine):
    """The HF engine, keeping every call's requests."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[Request]] = []

    def generate_requests(self, requests, params, interrupt=None) -> list[Generation]:
        self.calls.append(list(requests))
        return super().generate_requests(requests, params, interrupt)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: one thread is fastest, and unaffected by a busy machine (where
    intra-op threads wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    from megarl.models.hf_io import load_hf_tokenizer

    return load_hf_tokenizer(None)


@pytest.fixture(scope="module")
def model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


def prompt_ids(tokenizer, question: str) -> list[int]:
    """A prompt as the trainer encodes one (``encode_prompt``: the chat template as text)."""
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def teacher_forced_logprobs(model: LlamaForCausalLM, traj: Trajectory) -> torch.Tensor:
    """log_softmax(logits)[token] of every response token, from one forward of the whole
    trajectory (temperature 1)."""
    ids_T = torch.tensor(traj.token_ids)
    logprobs_TV = torch.log_softmax(model(ids_T.unsqueeze(0)).logits[0].float(), dim=-1)
    start = len(traj.prompt_ids)
    response_T1 = ids_T[start:].unsqueeze(-1)
    return logprobs_TV[start - 1 : -1].gather(-1, response_T1).squeeze(-1)


def split_turns(traj: Trajectory) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    """(first turn, observation, second turn) ids of a TwoTurns trajectory."""
    mask = traj.response_mask
    first = mask.index(0)
    second = first + mask[first:].index(1)
    ids = traj.response_ids
    return ids[:first], ids[first:second], ids[second:]


def test_two_turns_end_to_end_on_the_hf_engine(model, tokenizer):
    engine = RecordingEngine(model, tokenizer)
    samples = make_samples([prompt_ids(tokenizer, q) for q in QUESTIONS], seed=PARAMS.seed)
    result = run_agent_loops(engine, TwoTurns(), samples, PARAMS, tokenizer)
    assert [len(requests) for requests in engine.calls] == [4, 4]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    for sample, traj, second_request in zip(
        samples, result.trajectories, engine.calls[1], strict=True
    ):
        first, seen, second = split_turns(traj)
        assert tuple(seen) == tuple(observation)
        assert 1 <= len(first) <= 16 and 1 <= len(second) <= 16
        assert traj.response_mask == (1,) * len(first) + (0,) * len(seen) + (1,) * len(second)
        # the second turn continued exactly the ids so far: prompt, sampled ids, observation
        assert second_request.prompt_ids == sample.prompt_ids + tuple(first) + tuple(seen)
        assert traj.token_ids == second_request.prompt_ids + tuple(second)
        expected = teacher_forced_logprobs(model, traj)
        got = torch.tensor(traj.response_logprobs)
        trained = torch.tensor(traj.response_mask, dtype=torch.bool)
        torch.testing.assert_close(got[trained], expected[trained], atol=1e-4, rtol=0)
        assert (got[~trained] == 0).all()
    # a trajectory does not depend on what it was batched with: the third sample alone
    alone = run_agent_loops(engine, TwoTurns(), samples[2:3], PARAMS, tokenizer)
    assert alone.trajectories[0].token_ids == result.trajectories[2].token_ids


def test_single_turn_is_bitwise_the_plain_generate(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS for _ in range(2)]  # groups of 2
    plain = engine.generate(prompts, PARAMS)
    samples = make_samples(prompts, seed=PARAMS.seed)
    result = run_agent_loops(engine, SingleTurnLoop(), samples, PARAMS, tokenizer)
    for generation, traj in zip(plain, result.trajectories, strict=True):
        assert traj.prompt_ids == generation.prompt_ids
        assert traj.response_ids == generation.response_ids
        assert traj.response_logprobs == generation.response_logprobs  # bitwise
        assert traj.finish_reason == ("stop" if generation.finished else "length")
    assert len({traj.response_ids for traj in result.trajectories}) > 1

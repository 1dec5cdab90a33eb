"""Agent loops and their driver on a fake engine: batching, seeds, masks, and the tool loop.

The fake engine is deterministic the way the HF engine is: token ``j`` of a request depends on
the request's seed and ``j`` alone (or comes from a script keyed by the seed), so a trajectory
must come out the same whatever shares its engine calls. It records every call, so the tests
read off which turns were batched together. The tool loop runs on SmolLM2's real tokenizer and
chat template (no tool support: the renderer's fallback), loaded once per module.
"""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.agent_loops import OBSERVATION, TwoTurns
from helpers.engines import GenerateOnlyEngine

from megarl.agent import AgentLoop, GenerateOutput, Sample, Tool, ToolError, Trajectory
from megarl.agent.driver import (
    AgentContext,
    PartialRollouts,
    generate_output,
    make_samples,
    run_agent_loops,
    turn_seed,
)
from megarl.agent.loop import (
    AgentLoopError,
    AgentSettings,
    LoopChooser,
    SingleTurnLoop,
    ToolAgentLoop,
    resolve_loop,
)
from megarl.agent.metrics import trajectory_metrics, validation_trajectory_metrics
from megarl.engines.base import (
    Generation,
    Request,
    SamplingParams,
    request_seed,
    token_seed,
)
from megarl.errors import BadInputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
STEP_SEED = 1234
EOS = 2
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=STEP_SEED)


class FakeEngine(GenerateOnlyEngine):
    """Token ``j`` of a request is ``token_seed(seed, j)`` folded into ``[10, 1000)`` (never
    EOS), or the script for its seed; logprobs likewise. Records every call."""

    def __init__(
        self,
        scripts: Mapping[int, Sequence[int]] | None = None,
        fail_at: int = -1,
        eos: Sequence[int] = (EOS,),
    ):
        self.scripts = dict(scripts or {})
        self.eos = tuple(eos)
        """The model's end-of-sequence tokens (a chat template's end of turn among them)."""
        self.fail_at = fail_at
        """The number of the call (0-based) that raises; -1: none."""
        self.calls: list[tuple[list[Request], SamplingParams]] = []

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos

    def generate_requests(self, requests, params, interrupt=None) -> list[Generation]:
        self.calls.append((list(requests), params))
        if len(self.calls) - 1 == self.fail_at:
            raise RuntimeError("engine exploded")
        return [self._one(request, params) for request in requests]

    def _one(self, request: Request, params: SamplingParams) -> Generation:
        script = self.scripts.get(request.seed)
        budget = request.budget(params)
        if script is None:
            script = [10 + token_seed(request.seed, j) % 990 for j in range(budget)]
        tokens = tuple(script[:budget])
        finished = bool(tokens) and tokens[-1] in self.eos_token_ids
        logprobs = tuple(-((token_seed(request.seed, j) % 97) + 1) / 50 for j in range(len(tokens)))
        return Generation(request.prompt_ids, tokens, logprobs, finished)


def call_slots(engine: FakeEngine, samples: Sequence[Sample]) -> list[list[tuple[int, int]]]:
    """Each engine call as ``(sample index, turn)`` of its requests, read off the seeds."""
    by_seed = {turn_seed(s.seed, t): (s.index, t) for s in samples for t in range(8)}
    return [[by_seed[r.seed] for r in requests] for requests, _ in engine.calls]


def prompts(count: int) -> list[list[int]]:
    return [[100 + i, 200 + i, 300] for i in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    from megarl.models.hf_io import load_hf_tokenizer

    return load_hf_tokenizer(None)


class Turns(AgentLoop):
    """``turns`` generate calls of 4 tokens; before call ``t > 0`` sample ``i`` waits
    ``delays[i]`` seconds, marked busy (a tool call) or not."""

    def __init__(self, turns=2, delays: Sequence[float] = (), busy=True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.turns, self.delays, self.busy = turns, list(delays), busy

    async def run(self, sample, ctx):
        traj = Trajectory(sample.prompt_ids)
        for turn in range(self.turns):
            delay = self.delays[sample.index] if sample.index < len(self.delays) else 0.0
            if turn and delay:
                if self.busy:
                    with ctx.busy():
                        await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(delay)
            traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=4))
            traj.add_observation([7, 8, 9])
        return traj


def run(engine, loop, count=2, params=PARAMS, tokenizer=None, linger_s=0.0):
    """``loop`` on ``count`` samples; no linger unless asked, so that the tests' delays
    decide the batching."""
    samples = make_samples(prompts(count), None, params.seed)
    return run_agent_loops(engine, loop, samples, params, tokenizer, linger_s), samples


# --- the driver: batching, seeds, outputs ---------------------------------------------------


def test_two_turns_example_batches_turns_across_trajectories(tokenizer):
    engine = FakeEngine()
    result, samples = run(engine, TwoTurns(), count=2, tokenizer=tokenizer)
    assert call_slots(engine, samples) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]
    assert [s.seed for s in samples] == [request_seed(STEP_SEED, i) for i in range(2)]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    for sample, traj in zip(samples, result.trajectories, strict=True):
        first, second = (engine._one(r, PARAMS) for r in _requests_of(engine, sample))
        assert traj.prompt_ids == sample.prompt_ids
        assert traj.response_ids == first.response_ids + tuple(observation) + second.response_ids
        assert traj.response_mask == (1,) * 16 + (0,) * len(observation) + (1,) * 16
        assert traj.response_logprobs == (
            first.response_logprobs + (0.0,) * len(observation) + second.response_logprobs
        )
        assert traj.num_turns == 2 and traj.finish_reason == "length"
    second_requests = engine.calls[1][0]
    assert [r.prompt_ids for r in second_requests] == [
        t.prompt_ids + t.response_ids[: 16 + len(observation)] for t in result.trajectories
    ]
    assert result.metrics["agent/engine_calls"] == 2
    assert result.metrics["agent/num_turns/mean"] == 2 == result.metrics["agent/num_turns/max"]
    # 16 + observation + 16 tokens overrun the 16-token budget: trained cut to it, no
    # observation token kept (the metrics describe what trains)
    assert result.metrics["agent/observation_tokens/mean"] == 0
    assert result.metrics["agent/truncated_frac"] == 1.0
    assert result.metrics["agent/requests_per_engine_call/mean"] == 2
    assert result.metrics["agent/timing_s/gen_per_call"] >= 0


def _requests_of(engine: FakeEngine, sample: Sample) -> list[Request]:
    seeds = {turn_seed(sample.seed, t) for t in range(8)}
    return [r for requests, _ in engine.calls for r in requests if r.seed in seeds]


class VersionedEngine(FakeEngine):
    """Token ``j`` of a request depends on its seed, ``j`` and the weights' version (version 0:
    the plain fake's tokens). Newer weights "arrive" during call ``push_at``: that call's
    responses come back interrupted after ``after`` tokens, with the interrupt set."""

    def __init__(self, push_at: int, after: int):
        super().__init__()
        self.push_at, self.after = push_at, after
        self.version = 0

    def token(self, seed: int, j: int, version: int) -> int:
        return 10 + (token_seed(seed, j) + 7 * version) % 990

    def generate_requests(self, requests, params, interrupt=None) -> list[Generation]:
        self.calls.append((list(requests), params))
        pushed = len(self.calls) - 1 == self.push_at
        out = []
        for request in requests:
            start, budget = len(request.generated_ids), request.budget(params)
            count = min(budget, self.after) if pushed else budget
            positions = range(start, start + count)
            tokens = tuple(self.token(request.seed, j, self.version) for j in positions)
            logprobs = tuple(-((token_seed(request.seed, j) % 97) + 1) / 50 for j in positions)
            out.append(
                Generation(request.prompt_ids, tokens, logprobs, False, interrupted=count < budget)
            )
        if pushed:
            assert interrupt is not None, "partial rollouts pass the interrupt to the engine"
            interrupt.set()
        return out


def test_newer_weights_interrupt_a_turn_which_resumes_under_them_tokens_tagged(tokenizer):
    """Partial rollouts inside agent loops: the weights change 5 tokens into the first turn;
    the batcher loads them and resumes each response from its 5 tokens; the loop sees one
    output per turn whose tokens carry the version that sampled each."""
    engine = VersionedEngine(push_at=0, after=5)
    interrupt = threading.Event()
    loads = []

    def take_newer():
        assert interrupt.is_set()  # only an interrupt brings newer weights in
        engine.version += 1
        loads.append(engine.version)
        interrupt.clear()

    partial = PartialRollouts(interrupt, lambda: engine.version, take_newer)
    samples = make_samples(prompts(2), None, STEP_SEED)
    result = run_agent_loops(engine, TwoTurns(), samples, PARAMS, tokenizer, 0.0, partial)
    assert loads == [1] and not interrupt.is_set()
    assert call_slots(engine, samples) == [[(0, 0), (1, 0)], [(0, 0), (1, 0)], [(0, 1), (1, 1)]]
    observation = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    for sample, traj in zip(samples, result.trajectories, strict=True):
        first, resumed, second = _requests_of(engine, sample)
        assert resumed.seed == first.seed and resumed.prompt_ids == first.prompt_ids
        assert resumed.generated_ids == traj.response_ids[:5]  # goes on from its 5 tokens
        turn1 = [engine.token(first.seed, j, 0 if j < 5 else 1) for j in range(16)]
        turn2 = [engine.token(second.seed, j, 1) for j in range(16)]
        assert traj.response_ids == (*turn1, *observation, *turn2)
        assert traj.response_versions == (0,) * 5 + (1,) * (11 + len(observation) + 16)
        assert traj.response_logprobs[:16] == FakeEngine()._one(first, PARAMS).response_logprobs
        assert traj.num_turns == 2 and traj.finish_reason == "length"
    assert result.metrics["agent/engine_calls"] == 2  # a resumed call is part of its turn's


def test_without_newer_weights_a_turn_is_one_uninterrupted_call():
    engine = VersionedEngine(push_at=-1, after=5)
    partial = PartialRollouts(threading.Event(), lambda: 3, lambda: pytest.fail("no push"))
    result = run_agent_loops(
        engine,
        SingleTurnLoop(),
        make_samples(prompts(2), None, STEP_SEED),
        PARAMS,
        None,
        0.0,
        partial,
    )
    assert len(engine.calls) == 1
    assert [t.response_versions for t in result.trajectories] == [(3,) * 16] * 2


def test_single_turn_sends_exactly_the_plain_generate_call():
    plain, agent = FakeEngine(), FakeEngine()
    expected = plain.generate(prompts(5), PARAMS)
    result, _ = run(agent, SingleTurnLoop(), count=5)
    assert agent.calls == plain.calls  # one call: same requests, order, seeds and params
    for gen, traj in zip(expected, result.trajectories, strict=True):
        assert traj.response_ids == gen.response_ids
        assert traj.response_logprobs == gen.response_logprobs
        assert traj.response_mask == (1,) * len(gen.response_ids)


@pytest.mark.parametrize("delays", [(0.0, 0.03, 0.06), (0.06, 0.0, 0.03), (0.02, 0.02, 0.0)])
def test_trajectories_do_not_depend_on_timing_or_batching(delays):
    reference_engine = FakeEngine()
    reference, samples = run(reference_engine, Turns(turns=3), count=3)
    assert len(reference_engine.calls) == 3
    engine = FakeEngine()
    result, _ = run(engine, Turns(turns=3, delays=delays), count=3)
    assert len(engine.calls) > 3  # the delays split the later turns over more calls
    for a, b in zip(reference.trajectories, result.trajectories, strict=True):
        assert a.token_ids == b.token_ids and a.response_logprobs == b.response_logprobs
    # a sample run alone (same index and seed) samples the same again
    alone_engine = FakeEngine()
    alone = run_agent_loops(alone_engine, Turns(turns=3), samples[1:2], PARAMS, None, 0.0)
    assert alone.trajectories[0].token_ids == reference.trajectories[1].token_ids


def test_a_trajectory_busy_in_a_tool_does_not_hold_the_others():
    engine = FakeEngine()
    _, samples = run(engine, Turns(turns=3, delays=[0.5], busy=True), count=3)
    calls = call_slots(engine, samples)
    assert calls[0] == [(0, 0), (1, 0), (2, 0)]
    assert calls[1:3] == [[(1, 1), (2, 1)], [(1, 2), (2, 2)]]
    assert calls[3:] == [[(0, 1)], [(0, 2)]]


def test_a_ready_batch_lingers_for_fast_tools():
    """Trajectories back from their tools within ``linger_s`` join the call; a slower one
    does not hold it."""
    engine = FakeEngine()
    delays = [0.01, 0.02, 0.5]
    _, samples = run(engine, Turns(turns=2, delays=delays), count=3, linger_s=0.2)
    assert call_slots(engine, samples) == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1)], [(2, 1)]]


def test_an_unmarked_await_is_waited_for():
    """Only ``ctx.busy()`` lets the batch go without a trajectory: one that awaits anything
    else may be about to ask for a turn, so its turn joins the others'."""
    engine = FakeEngine()
    _, samples = run(engine, Turns(turns=3, delays=[0.05], busy=False), count=3)
    assert call_slots(engine, samples) == [[(0, t), (1, t), (2, t)] for t in range(3)]


class Overrides(AgentLoop):
    """Sample ``i`` asks for ``limits[i]`` tokens at temperature ``temperatures[i]``."""

    def __init__(self, limits, temperatures=None, **kwargs):
        super().__init__(**kwargs)
        self.limits, self.temperatures = limits, temperatures

    async def run(self, sample, ctx):
        traj = Trajectory(sample.prompt_ids)
        temperature = self.temperatures[sample.index] if self.temperatures else None
        out = await ctx.generate(
            traj.token_ids, max_new_tokens=self.limits[sample.index], temperature=temperature
        )
        traj.add_generated(out)
        return traj


def test_different_limits_share_a_call_each_request_carrying_its_own():
    engine = FakeEngine()
    result, samples = run(engine, Overrides([3, 9, 5]), count=3)
    assert len(engine.calls) == 1 and engine.calls[0][1].max_new_tokens == 9
    # the engine is told each limit (None: the call's), so it stops each request there
    assert [r.max_new_tokens for r in engine.calls[0][0]] == [3, None, 5]
    assert [r.budget(engine.calls[0][1]) for r in engine.calls[0][0]] == [3, 9, 5]
    for sample, traj, limit in zip(samples, result.trajectories, [3, 9, 5], strict=True):
        alone = SamplingParams(temperature=1.0, max_new_tokens=limit)
        own = engine._one(Request(sample.prompt_ids, sample.seed), alone)
        assert traj.response_ids == own.response_ids and len(own.response_ids) == limit
        assert traj.response_logprobs == own.response_logprobs
        assert traj.finish_reason == "length"


def test_different_temperatures_go_in_separate_calls():
    engine = FakeEngine()
    _, samples = run(engine, Overrides([4, 4, 4], [1.0, 0.5, 1.0]), count=3)
    assert call_slots(engine, samples) == [[(0, 0), (2, 0)], [(1, 0)]]
    assert [params.temperature for _, params in engine.calls] == [1.0, 0.5]


def test_generate_output_maps_finish_reasons_and_cuts():
    def gen(tokens, finished=False, interrupted=False):
        return Generation(
            (1,), tokens, tuple(-0.5 for _ in tokens), finished, None, None, interrupted
        )

    assert generate_output(gen((5, EOS), finished=True), 8).finish_reason == "stop"
    assert generate_output(gen((5, 6), interrupted=True), 8).finish_reason == "abort"
    assert generate_output(gen((5, 6)), 2).finish_reason == "length"
    cut = generate_output(gen((5, 6, 7, EOS), finished=True), 2)
    assert cut == GenerateOutput((5, 6), (-0.5, -0.5), "length")


def test_unknown_override_is_refused():
    class SeedOverride(AgentLoop):
        async def run(self, sample, ctx):
            await ctx.generate(sample.prompt_ids, seed=3)
            raise AssertionError("unreachable")

    with pytest.raises(TypeError, match="unknown sampling override 'seed'"):
        run(FakeEngine(), SeedOverride(), count=1)


def test_engine_failure_reaches_the_caller():
    with pytest.raises(RuntimeError, match="engine exploded"):
        run(FakeEngine(fail_at=0), SingleTurnLoop(), count=3)


def test_a_failing_loop_stops_the_step_and_the_others_unwind():
    unwound: list[int] = []

    class FailsOnce(AgentLoop):
        async def run(self, sample, ctx):
            try:
                with ctx.busy():
                    if sample.index == 1:
                        await asyncio.sleep(0.01)
                        raise KeyError("loop bug")
                    await asyncio.sleep(5)
            finally:
                unwound.append(sample.index)
            raise AssertionError("unreachable")

    started = time.perf_counter()
    with pytest.raises(KeyError, match="loop bug"):
        run(FakeEngine(), FailsOnce(), count=3)
    assert sorted(unwound) == [0, 1, 2] and time.perf_counter() - started < 2


def test_run_must_return_a_trajectory():
    class ReturnsNone(AgentLoop):
        async def run(self, sample, ctx):
            return None

    with pytest.raises(TypeError, match="ReturnsNone.run returned a NoneType"):
        run(FakeEngine(), ReturnsNone(), count=1)


def test_no_samples_no_calls():
    engine = FakeEngine()
    result = run_agent_loops(engine, SingleTurnLoop(), [], PARAMS, None)
    assert result.trajectories == [] and engine.calls == []


def test_make_samples_seeds_and_lengths():
    samples = make_samples(prompts(3), [{"a": 1}] * 3, seed=9)
    assert [s.seed for s in samples] == [request_seed(9, i) for i in range(3)]
    assert [s.index for s in samples] == [0, 1, 2] and samples[0].row == {"a": 1}
    assert turn_seed(samples[0].seed, 0) == samples[0].seed != turn_seed(samples[0].seed, 1)
    with pytest.raises(ValueError, match="3 prompts but 2 rows"):
        make_samples(prompts(3), [{}] * 2)


# --- choosing a loop ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("single_turn", SingleTurnLoop),
        ("tool", ToolAgentLoop),
        ("single_turn_agent", SingleTurnLoop),
        ("tool_agent", ToolAgentLoop),
        ("megarl.agent.loop:SingleTurnLoop", SingleTurnLoop),
        ("megarl.agent.loop.ToolAgentLoop", ToolAgentLoop),
        ("helpers.agent_loops:TwoTurns", TwoTurns),
    ],
)
def test_resolve_loop(name, expected):
    assert resolve_loop(name) is expected


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("multi", "not a built-in loop (single_turn, tool, openai) nor a class path"),
        ("", "expected a loop name"),
        ("no_such_module_xyz:Loop", "module 'no_such_module_xyz' not found"),
        ("megarl.agent.loop:Nope", "module 'megarl.agent.loop' has no 'Nope'"),
        ("megarl.agent.loop:Sample", "is not a subclass of megarl.agent.AgentLoop"),
        ("megarl.agent.loop:AgentLoop", "does not implement run"),
    ],
)
def test_resolve_loop_errors_name_the_key(name, message):
    with pytest.raises(AgentLoopError, match="rollout.agent.loop=") as caught:
        resolve_loop(name)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, BadInputError) and caught.value.exit_code == 2


def test_rows_choose_their_loop_with_agent_name(tokenizer):
    chooser = LoopChooser(AgentSettings(), tokenizer)
    plain, tool, bad = make_samples(
        prompts(3), [{}, {"agent_name": "tool_agent"}, {"agent_name": "nope"}]
    )
    assert type(chooser(plain)) is SingleTurnLoop and chooser(plain) is chooser(plain)
    assert type(chooser(tool)) is ToolAgentLoop
    with pytest.raises(AgentLoopError, match="sample 2: agent_name='nope'"):
        chooser(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_turns": 0}, "rollout.agent.max_turns=0"),
        ({"max_tool_response_tokens": 0}, "rollout.agent.max_tool_response_tokens=0"),
        ({"tool_timeout_s": 0}, "rollout.agent.tool_timeout_s=0"),
        ({"tool_format": "xml"}, "rollout.agent.tool_format='xml'"),
    ],
)
def test_settings_are_checked(kwargs, message):
    with pytest.raises(BadInputError, match=message):
        AgentSettings(**kwargs)


# --- the tool loop --------------------------------------------------------------------------


def schema(name: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind} for key, kind in properties.items()},
                "required": list(properties),
            },
        },
    }


class Add(Tool):
    """Adds two integers; its state records the row's kwargs and the release."""

    def __init__(self, log: list) -> None:
        super().__init__({}, schema("add", a="integer", b="integer"))
        self.log = log

    async def create(self, tools_kwargs):
        self.log.append(("create", dict(tools_kwargs)))
        return {"offset": tools_kwargs.get("offset", 0)}

    async def execute(self, arguments, state):
        return str(arguments["a"] + arguments["b"] + state["offset"])

    async def release(self, state):
        self.log.append(("release", state["offset"]))


class Meet(Tool):
    """Returns only once ``parties`` calls are running at the same time."""

    def __init__(self, parties: int = 2) -> None:
        super().__init__({}, schema("meet", who="string"))
        self.parties, self.arrived, self.all_here = parties, 0, None

    async def execute(self, arguments, state):
        if self.all_here is None:
            self.all_here = asyncio.Event()
        self.arrived += 1
        if self.arrived == self.parties:
            self.all_here.set()
        await self.all_here.wait()
        return f"met {arguments['who']}"


class Fails(Tool):
    def __init__(self) -> None:
        super().__init__({}, schema("fails", how="string"))

    async def execute(self, arguments, state):
        if arguments["how"] == "tool_error":
            raise ToolError("division by zero in your expression")
        if arguments["how"] == "bug":
            raise RuntimeError("the tool has a bug")
        if arguments["how"] == "hang":
            await asyncio.sleep(30)
        if arguments["how"] == "long":
            return " ".join(f"word{i}" for i in range(200))
        if arguments["how"] == "huge":
            return "ab" * 2_000_000
        if arguments["how"] == "exit":
            raise SystemExit(False)  # what unittest.main() raises when the tests pass
        if arguments["how"] == "thread_exit":
            await asyncio.to_thread(sys.exit, 0)
        return 42  # not text


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
TOOL_PARAMS = SamplingParams(max_new_tokens=400, seed=STEP_SEED)


def tool_run(
    tokenizer,
    turns: Sequence[Sequence[str]],
    tools: Iterable[Tool],
    settings: AgentSettings | None = None,
    params: SamplingParams = TOOL_PARAMS,
    rows: Sequence[Mapping[str, Any]] | None = None,
):
    """The tool loop on scripted turns (``turns[i]``: sample ``i``'s assistant texts, each
    sampled with the end-of-turn token after it)."""
    settings = settings or AgentSettings(loop="tool", tool_timeout_s=2.0)
    loop = ToolAgentLoop(settings, tokenizer, {tool.name: tool for tool in tools})
    prompt = loop.prompt_ids(QUESTION)
    samples = make_samples([prompt] * len(turns), rows, params.seed, [QUESTION] * len(turns))
    eot = loop.renderer.end_of_turn_id
    scripts = {
        turn_seed(sample.seed, t): [*loop.renderer.encode(text), eot]
        for sample, texts in zip(samples, turns, strict=True)
        for t, text in enumerate(texts)
    }
    engine = FakeEngine(scripts, eos=(EOS, eot))
    result = run_agent_loops(engine, loop, samples, params, tokenizer)
    return result, loop, engine


def observations(loop: ToolAgentLoop, traj: Trajectory) -> list[str]:
    """The text of each run of observation tokens."""
    runs: list[list[int]] = []
    previous = 1
    for token, mask in zip(traj.response_ids, traj.response_mask, strict=True):
        if mask == 0:
            if previous == 1:
                runs.append([])
            runs[-1].append(token)
        previous = mask
    return [loop.renderer.decode(ids) for ids in runs]


def trained_text(loop: ToolAgentLoop, traj: Trajectory) -> str:
    return loop.renderer.decode(
        [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
    )


def test_no_tool_call_ends_after_one_turn(tokenizer):
    log: list = []
    result, loop, _ = tool_run(tokenizer, [["It is 19."]], [Add(log)])
    (traj,) = result.trajectories
    assert traj.num_turns == 1 and traj.tool_calls == 0 and traj.observation_tokens == 0
    assert traj.finish_reason == "stop" and traj.finished
    assert trained_text(loop, traj) == "It is 19.<|im_end|>"
    assert log == []  # no state created for a tool never called


def test_one_call_renders_the_result_as_the_template_does(tokenizer):
    log: list = []
    turns = [[call("add", a=12, b=7), "It is 19."]]
    rows = [{"extra_info": {"tools_kwargs": {"add": {"offset": 0}}}}]
    result, loop, engine = tool_run(tokenizer, turns, [Add(log)], rows=rows)
    (traj,) = result.trajectories
    assert traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 0
    assert log == [("create", {"offset": 0}), ("release", 0)]
    (observation,) = observations(loop, traj)
    assert observation == (
        "\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "tool_response" not in trained_text(loop, traj)
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": turns[0][0]},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": turns[0][1]},
    ]
    whole = loop.renderer.render_text(conversation, add_generation_prompt=False)
    assert loop.renderer.decode(traj.token_ids) + "\n" == whole
    # the second turn continued exactly these ids, asking for what was left of the budget
    second, params = engine.calls[1][0][0], engine.calls[1][1]
    assert second.prompt_ids == traj.token_ids[: len(second.prompt_ids)]
    assert params.max_new_tokens == 400 - (len(second.prompt_ids) - len(traj.prompt_ids))


def test_two_calls_in_one_turn_run_concurrently_and_answer_in_order(tokenizer):
    log: list = []
    turn = f"{call('meet', who='ann')}\n{call('add', a=1, b=2)}\n{call('meet', who='bob')}"
    result, loop, _ = tool_run(tokenizer, [[turn, "Done."]], [Meet(parties=2), Add(log)])
    (traj,) = result.trajectories
    assert traj.tool_calls == 3 and traj.tool_errors == 0
    (observation,) = observations(loop, traj)
    blocks = [b.split("\n</tool_response>")[0] for b in observation.split("<tool_response>\n")[1:]]
    assert blocks == ["met ann", "3", "met bob"]


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("tool_error", "Error: division by zero in your expression"),
        ("bug", "Error: fails failed: RuntimeError: the tool has a bug"),
        ("hang", "Error: fails timed out after 0.05 s"),
        ("int", "Error: fails returned a int, not text"),
        ("exit", "Error: fails failed: SystemExit(False)"),
        ("thread_exit", "Error: fails failed: SystemExit(0)"),
    ],
)
def test_a_failing_tool_is_an_error_observation(tokenizer, how, expected):
    settings = AgentSettings(loop="tool", tool_timeout_s=0.05)
    started = time.perf_counter()
    result, loop, _ = tool_run(
        tokenizer, [[call("fails", how=how), "Sorry."]], [Fails()], settings=settings
    )
    assert time.perf_counter() - started < 5
    (traj,) = result.trajectories
    assert traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 1
    (observation,) = observations(loop, traj)
    assert f"<tool_response>\n{expected}\n</tool_response>" in observation
    assert result.metrics["agent/tool_errors"] == 1


def test_bad_calls_are_error_observations(tokenizer):
    log: list = []
    turn = "\n".join(
        [
            '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
            call("subtract", a=1, b=2),
            call("add", a="one", b=2),
            call("add", a=1, b=2),
        ]
    )
    result, loop, _ = tool_run(tokenizer, [[turn, "Hm."]], [Add(log)])
    (traj,) = result.trajectories
    assert traj.tool_calls == 4 and traj.tool_errors == 3
    (observation,) = observations(loop, traj)
    assert "Error: tool call 1: malformed JSON" in observation
    assert "Error: tool call 2: unknown tool 'subtract' (the tools are: add)" in observation
    assert "Error: tool call 3 (add): argument 'a' must be of type integer" in observation
    assert "<tool_response>\n3\n</tool_response>" in observation


def test_max_turns_ends_before_running_the_last_turns_calls(tokenizer):
    log: list = []
    turns = [[call("add", a=1, b=t) for t in range(5)]]
    settings = AgentSettings(loop="tool", max_turns=2)
    result, loop, engine = tool_run(tokenizer, turns, [Add(log)], settings=settings)
    (traj,) = result.trajectories
    assert traj.num_turns == 2 and traj.tool_calls == 1 and len(engine.calls) == 2
    assert len(observations(loop, traj)) == 1 and traj.response_mask[-1] == 1
    assert log[-1] == ("release", 0)


def test_the_response_budget_bounds_turns_and_observations(tokenizer):
    log: list = []
    turns = [[call("add", a=1, b=t) for t in range(20)]]
    result, _, engine = tool_run(
        tokenizer, turns, [Add(log)], params=SamplingParams(max_new_tokens=90, seed=STEP_SEED)
    )
    (traj,) = result.trajectories
    assert len(traj.response_ids) == 90 and traj.truncated
    limits = [params.max_new_tokens for _, params in engine.calls]
    assert limits[0] == 90 and limits == sorted(limits, reverse=True)
    assert log[-1][0] == "release"


def test_a_long_tool_output_is_truncated_and_says_so(tokenizer):
    settings = AgentSettings(loop="tool", max_tool_response_tokens=8)
    result, loop, _ = tool_run(
        tokenizer, [[call("fails", how="long"), "Ok."]], [Fails()], settings=settings
    )
    (observation,) = observations(loop, result.trajectories[0])
    assert "word0 word1" in observation and "word150" not in observation
    assert "(truncated: the first 8 tokens of an answer of 1489 characters shown)" in observation
    assert result.metrics["agent/tool_errors"] == 1  # a cut answer is an error observation


def test_a_huge_tool_answer_is_cut_by_characters_before_it_is_tokenized(tokenizer, monkeypatch):
    """A tool that returns 4 MB: only the head the token limit can keep is tokenized."""
    from megarl.agent.render import ChatRenderer

    encoded: list[int] = []
    encode = ChatRenderer.encode

    def spy(self, text):
        encoded.append(len(text))
        return encode(self, text)

    monkeypatch.setattr(ChatRenderer, "encode", spy)
    settings = AgentSettings(loop="tool", max_tool_response_tokens=8)
    result, loop, _ = tool_run(
        tokenizer, [[call("fails", how="huge"), "Ok."]], [Fails()], settings=settings
    )
    assert max(encoded) <= 8 * 16 + 1000  # the cut head (and the turns' own short texts)
    (observation,) = observations(loop, result.trajectories[0])
    assert "(truncated: the first 8 tokens of an answer of 4000000 characters shown)" in (
        observation
    )
    assert result.metrics["agent/tool_errors"] == 1


def test_a_turn_cut_by_its_budget_runs_no_tool(tokenizer):
    log: list = []
    turns = [[call("add", a=1, b=2)]]
    result, _, engine = tool_run(
        tokenizer, turns, [Add(log)], params=SamplingParams(max_new_tokens=10, seed=STEP_SEED)
    )
    (traj,) = result.trajectories
    assert traj.num_turns == 1 and traj.finish_reason == "length" and traj.tool_calls == 0
    assert log == [] and len(engine.calls) == 1


def test_tool_state_is_released_when_the_step_fails(tokenizer):
    log: list = []
    result, loop, engine = tool_run(tokenizer, [[call("add", a=1, b=2), "x"]], [Add(log)])
    samples = make_samples([result.trajectories[0].prompt_ids], None, STEP_SEED, [QUESTION])
    failing = FakeEngine(engine.scripts, fail_at=1)  # the turn after the tool call
    log.clear()
    with pytest.raises(RuntimeError, match="engine exploded"):
        run_agent_loops(failing, loop, samples, engine.calls[0][1], tokenizer)
    assert log == [("create", {}), ("release", 0)]


def test_trajectories_of_a_tool_step_share_engine_calls(tokenizer):
    log: list = []
    turns = [
        [call("add", a=1, b=1), "Two."],
        ["No tools needed."],
        [call("add", a=2, b=2), call("add", a=3, b=3), "Six."],
    ]
    result, _, engine = tool_run(tokenizer, turns, [Add(log)])
    assert [len(requests) for requests, _ in engine.calls] == [3, 2, 1]
    assert [t.num_turns for t in result.trajectories] == [2, 1, 3]
    assert result.metrics["agent/tool_calls/mean"] == 1.0
    assert result.metrics["agent/num_turns/max"] == 3


def test_a_template_that_cannot_continue_the_ids_ends_the_trajectory(tokenizer):
    """Qwen3's template re-renders an earlier turn without reasoning once a tool result
    follows: no observation continues the sampled ids, so the trajectory ends there."""
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = (FIXTURES / "qwen3_style.jinja").read_text()
    log: list = []
    with pytest.warns(UserWarning, match="cannot be continued exactly"):
        result, _, engine = tool_run(qwen3, [[call("add", a=1, b=2), "3"]], [Add(log)])
    (traj,) = result.trajectories
    assert traj.num_turns == 1 and traj.tool_calls == 1 and len(engine.calls) == 1
    assert result.metrics["agent/prefix_breaks"] == 1 and log[-1] == ("release", 0)


def test_the_prompt_must_be_the_tool_loops_rendering(tokenizer):
    loop = ToolAgentLoop(AgentSettings(loop="tool"), tokenizer, {"add": Add([])})
    plain = SingleTurnLoop(tokenizer=tokenizer).prompt_ids(QUESTION)  # no tools described
    samples = make_samples([plain], None, 0, [QUESTION])
    with pytest.raises(ValueError, match="encode tool prompts with ToolAgentLoop.prompt_ids"):
        run_agent_loops(FakeEngine(), loop, samples, PARAMS, tokenizer)
    rowless = make_samples([loop.prompt_ids(QUESTION)])
    with pytest.raises(ValueError, match="needs the prompt's chat messages"):
        run_agent_loops(FakeEngine(), loop, rowless, PARAMS, tokenizer)
    # verl's 'prompt' column serves when the sample carries no messages
    from_row = make_samples([loop.prompt_ids(QUESTION)], [{"prompt": QUESTION}])
    run_agent_loops(FakeEngine(), loop, from_row, SamplingParams(max_new_tokens=4), tokenizer)


def test_context_counters_are_summed_into_metrics():
    class Counts(AgentLoop):
        async def run(self, sample, ctx: AgentContext):
            ctx.count("retries", sample.index)
            traj = Trajectory(sample.prompt_ids)
            traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=2))
            return traj

    result, _ = run(FakeEngine(), Counts(), count=3)
    assert result.metrics["agent/retries"] == 3.0


def test_validation_reports_turns_under_verls_names_and_the_rest_under_val_aux_agent():
    class OneOrTwoTurns(AgentLoop):
        async def run(self, sample, ctx: AgentContext):
            traj = Trajectory(sample.prompt_ids)
            for _ in range(1 + sample.index % 2):
                traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=2))
            return traj

    result, _ = run(FakeEngine(), OneOrTwoTurns(), count=3)
    metrics = validation_trajectory_metrics(result.trajectories)
    assert metrics["val-aux/num_turns/min"] == 1.0
    assert metrics["val-aux/num_turns/max"] == 2.0
    assert metrics["val-aux/num_turns/mean"] == pytest.approx(4 / 3)
    step = trajectory_metrics(result.trajectories)
    assert metrics["val-aux/agent/tool_calls/mean"] == step["agent/tool_calls/mean"]
    assert metrics["val-aux/agent/observation_tokens/mean"] == 0.0
    assert not any(key.startswith("val-aux/agent/num_turns") for key in metrics)
    assert validation_trajectory_metrics([]) == {}  # a single-turn validation: none


def test_llama3_json_calls_on_a_llama3_template_render_results_under_ipython(tokenizer):
    """``tool_format=llama3_json`` with a Llama-3.1-style template, which renders the tools
    itself (in the first user message) and a tool result as an ``ipython`` turn."""
    import copy
    from pathlib import Path

    llama3 = copy.deepcopy(tokenizer)
    llama3.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
    llama3.chat_template = (fixtures / "llama3_style.jinja").read_text()
    settings = AgentSettings(loop="tool", tool_timeout_s=2.0, tool_format="llama3_json")
    first = json.dumps({"name": "add", "parameters": {"a": 12, "b": 7}})
    result, loop, _ = tool_run(llama3, [[first, "It is 19."]], [Add([])], settings=settings)
    (traj,) = result.trajectories
    assert loop.renderer.native_tools and loop.renderer.end_of_turn == "<|eot_id|>"
    assert traj.num_turns == 2 and traj.tool_calls == 1 and traj.tool_errors == 0
    (observation,) = observations(loop, traj)
    assert observation == (  # Llama 3.1's template quotes a string result (tojson)
        '<|start_header_id|>ipython<|end_header_id|>\n\n"19"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert trained_text(loop, traj) == f"{first}<|eot_id|>It is 19.<|eot_id|>"
    prompt = loop.renderer.decode(traj.prompt_ids)
    assert '"name": "add"' in prompt and "Respond in the format" in prompt


def test_a_stop_request_inside_a_tool_stops_the_step_instead_of_becoming_an_observation(
    tokenizer,
):
    """SIGTERM's handler raises :class:`RunStopped` wherever the main thread is: inside a tool
    it is not the model's error to read but the run's stop."""
    from megarl.errors import RunStopped

    class Stopped(Tool):
        def __init__(self) -> None:
            super().__init__({}, schema("stop", why="string"))

        async def execute(self, arguments, state):
            raise RunStopped(15)

    with pytest.raises(RunStopped):
        tool_run(tokenizer, [[call("stop", why="now"), "done"]], [Stopped()])


def test_a_tool_that_exits_or_interrupts_itself_is_an_error_observation_not_the_runs_end(
    tokenizer, monkeypatch
):
    """Under megarl-train SIGINT raises RunStopped, so a KeyboardInterrupt is the tool's own;
    a SystemExit from ``create`` or ``execute`` is that call's failure, warned with where."""
    monkeypatch.setattr(signal, "getsignal", lambda sig: lambda *args: None)

    class Exits(Tool):
        def __init__(self, name: str, hook: str, exc: BaseException) -> None:
            super().__init__({}, schema(name, x="integer"))
            self.hook, self.exc = hook, exc

        async def create(self, tools_kwargs):
            if self.hook == "create":
                raise self.exc
            return {}

        async def execute(self, arguments, state):
            raise self.exc

    tools = [
        Exits("interrupts", "execute", KeyboardInterrupt()),
        Exits("exits_early", "create", SystemExit(0)),
    ]
    turn = call("interrupts", x=1) + "\n" + call("exits_early", x=2)
    with pytest.warns(UserWarning, match=r"tool exits_early failed: SystemExit\(0\) \(at "):
        result, loop, _ = tool_run(tokenizer, [[turn, "Sorry."]], tools)
    (traj,) = result.trajectories
    assert traj.num_turns == 2 and traj.tool_errors == 2
    (observation,) = observations(loop, traj)
    assert "Error: interrupts failed: KeyboardInterrupt\n" in observation
    assert "Error: exits_early failed: SystemExit(0)\n" in observation


def test_a_loop_that_raises_system_exit_fails_its_step_naming_loop_and_sample():
    from megarl.user_code import UserCodeExit

    class ExitsOnTwo(AgentLoop):
        async def run(self, sample, ctx):
            traj = Trajectory(sample.prompt_ids, ctx.max_response_tokens)
            traj.add_generated(await ctx.generate(traj.token_ids))
            if sample.index == 2:
                sys.exit(0)
            return traj

    with pytest.raises(UserCodeExit) as failed:
        run(FakeEngine(), ExitsOnTwo(), count=3)
    message = str(failed.value)
    assert message.startswith("agent loop ExitsOnTwo: run (sample 2) raised SystemExit(0) (at ")
    assert "test_agent_loop.py:" in message


def test_a_tool_whose_worker_thread_never_returns_times_out_without_holding_the_step(
    tokenizer,
):
    """The blocking work runs in ``asyncio.to_thread`` as advised, and never returns: the
    call is a timeout error on time, and the step ends without waiting for the thread."""
    release = threading.Event()

    class Stuck(Tool):
        def __init__(self) -> None:
            super().__init__({}, schema("stuck", x="integer"))

        async def execute(self, arguments, state):
            await asyncio.to_thread(release.wait, 20)
            return "never"

    settings = AgentSettings(loop="tool", tool_timeout_s=0.2)
    started = time.perf_counter()
    try:
        with pytest.warns(UserWarning, match=r"tool stuck: execute \(sample 0\)"):
            result, loop, _ = tool_run(
                tokenizer, [[call("stuck", x=1), "Hm."]], [Stuck()], settings=settings
            )
        elapsed = time.perf_counter() - started
    finally:
        release.set()
    assert elapsed < 5
    (observation,) = observations(loop, result.trajectories[0])
    assert "Error: stuck timed out after 0.2 s" in observation
    assert result.metrics["agent/abandoned_threads"] == 1
    assert result.metrics["agent/tool_errors"] == 1


def test_the_metrics_describe_a_trajectory_as_trained_cut_to_the_budget():
    """A loop that builds its trajectory without the budget (16 tokens here) overruns it; the
    response is cut to 16 before training, so the metrics count it truncated and count only
    the observation tokens that were kept."""

    class NoBudget(AgentLoop):
        async def run(self, sample, ctx):
            traj = Trajectory(sample.prompt_ids)  # no ctx.max_response_tokens
            traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=10))
            traj.add_observation([7] * 10)
            traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=10))
            return traj

    result, _ = run(FakeEngine(), NoBudget(), count=1)
    assert len(result.trajectories[0].response_ids) == 30
    assert result.metrics["agent/truncated_frac"] == 1.0
    assert result.metrics["agent/observation_tokens/mean"] == 6.0


class ExitsInInit(SingleTurnLoop):
    """A user loop whose constructor checks its environment and exits."""

    def __init__(self, **kwargs) -> None:
        raise SystemExit(0)


def test_a_user_loop_whose_constructor_exits_is_one_bad_input_line():
    from megarl.agent.loop import build_loop

    name = f"{__name__}:ExitsInInit"
    with pytest.raises(AgentLoopError) as refused:
        build_loop(name, AgentSettings(), None)
    message = str(refused.value)
    assert message.startswith(f"rollout.agent.loop={name!r}: ExitsInInit(settings=..., ")
    assert "failed: SystemExit(0) (at " in message and refused.value.exit_code == 2


class SetsUp(AgentLoop):
    """A user loop that builds what it needs once, in ``setup``."""

    def setup(self) -> None:
        self.seen = (self.settings.max_turns, self.tokenizer, sorted(self.tools))

    async def run(self, sample, ctx):
        raise AssertionError("not run here")


def test_setup_runs_once_with_the_settings_tokenizer_and_tools_of_the_run(tokenizer):
    """Every loop is constructed the same way: ``setup`` sees what it was given, and tools not
    given are those of ``tool_config_path`` (what :class:`LoopChooser` hands every loop)."""
    from megarl.agent.loop import build_loop

    tools_yaml = str(Path(__file__).resolve().parents[2] / "examples" / "tools" / "calculator.yaml")
    settings = AgentSettings(max_turns=2, tool_config_path=tools_yaml)
    name = f"{__name__}:SetsUp"
    built = build_loop(name, settings, tokenizer)
    assert isinstance(built, SetsUp) and built.seen == (2, tokenizer, ["calculator"])
    chosen = LoopChooser(AgentSettings(loop=name, tool_config_path=tools_yaml), None)
    loop = chosen(make_samples(prompts(1))[0])
    assert isinstance(loop, SetsUp) and loop.seen == (None, None, ["calculator"])
    assert SetsUp(settings, tokenizer, tools={}).seen == (2, tokenizer, [])


def test_engine_calls_run_outside_every_user_call(tokenizer):
    """The engine's worker thread is the rollout's, not the loop's whose turn started the
    batch: a stuck engine call is never reported as a user call (nor published as one)."""
    from megarl.user_code import current_user_call

    seen: list[str | None] = []

    class Recording(FakeEngine):
        def generate_requests(self, requests, params, interrupt=None):
            seen.append(current_user_call())
            return super().generate_requests(requests, params, interrupt)

    run(Recording(), TwoTurns(), count=2, tokenizer=tokenizer)
    assert seen == [None, None]


def test_where_tokens_are_longer_than_the_character_bound_the_note_says_characters(
    tokenizer, monkeypatch
):
    """A tokenizer whose tokens hold 100 characters: the character cut keeps fewer than the
    token limit, and the note names characters, not a token count it never made."""
    from megarl.agent.render import ChatRenderer

    encode = ChatRenderer.encode
    monkeypatch.setattr(
        ChatRenderer,
        "encode",
        lambda self, text: (
            [1] * (len(text) // 100) if text.startswith("ab") else encode(self, text)
        ),
    )
    settings = AgentSettings(loop="tool", max_tool_response_tokens=8)
    loop = ToolAgentLoop(settings, tokenizer, {})
    text, cut = loop._truncate("ab" * 2_000_000)
    assert (
        cut and text == "ab" * 64 + "\n... (truncated: the first 128 of 4000000 characters shown)"
    )
    assert loop._truncate("short") == ("short", False)

"""The agent gateway with real clients (the ``openai`` and ``anthropic`` SDKs, the OpenAI Agents
SDK), unmodified, on a scripted engine and SmolLM2's real tokenizer and chat template.

The engine writes a scripted reply to each request (a tool call where tools were offered and no
result came back yet, else a number) and records every sampled id sequence, so the tests check
what matters for training by ids, not text: every token with mask 1 is one the engine sampled,
in the order it sampled them, and every other token is the template's rendering of what the
agent sent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers.chat import tool_call_message
from helpers.engines import GenerateOnlyEngine

from megarl.agent.driver import make_samples, run_agent_loops
from megarl.agent.gateway import GatewayError, serve
from megarl.agent.gateway.agent_loop import AgentFailedError, GatewayLoop
from megarl.agent.gateway.protocol import parse_anthropic, parse_openai
from megarl.agent.gateway.settings import GatewaySettings
from megarl.agent.loop import AgentLoopError, AgentSettings, RunFacts
from megarl.agent.trajectory import Trajectory
from megarl.engines.base import (
    Generation,
    SamplingParams,
)
from megarl.errors import BadInputError

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=64, seed=7)
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def scripted_reply(context: str) -> str:
    """A tool call when tools are described and none was answered yet; else an answer."""
    if '"name": "add"' in context and "<tool_response>\n" not in context:
        return TOOL_CALL
    return "19"


class ScriptedEngine(GenerateOnlyEngine):
    """Replies ``reply(decoded context)`` then the end-of-turn token; logprob ``-(j+1)/100``
    for token ``j``. Records every response it sampled."""

    def __init__(self, tokenizer, reply: Callable[[str], str] = scripted_reply) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.sampled: list[tuple[int, ...]] = []
        self.calls = 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.end_of_turn,)

    def generate_requests(self, requests, params, interrupt=None) -> list[Generation]:
        self.calls += 1
        out = []
        for request in requests:
            text = self.tokenizer.decode(list(request.context_ids), skip_special_tokens=False)
            ids = self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"]
            ids = (*ids, self.end_of_turn)[: request.budget(params)]
            self.sampled.append(tuple(ids))
            logprobs = tuple(-(j + 1) / 100 for j in range(len(ids)))
            finished = bool(ids) and ids[-1] == self.end_of_turn
            out.append(Generation(request.prompt_ids, ids, logprobs, finished))
        return out


@pytest.fixture(scope="module")
def tokenizer():
    from megarl.models.hf_io import load_hf_tokenizer

    return load_hf_tokenizer(None)


QUESTION = [
    {"role": "system", "content": "Answer with just the number."},
    {"role": "user", "content": "What is 12 + 7?"},
]


def gateway_loop(tokenizer, agent: str, **settings) -> GatewayLoop:
    facts = RunFacts(
        reward_error=settings.pop("reward_error", "raise"),
        max_prompt_tokens=settings.pop("max_prompt_tokens", None),
    )
    gateway = GatewaySettings(session_timeout_s=settings.pop("session_timeout_s", 60.0))
    loop = GatewayLoop(
        AgentSettings(
            loop="openai", entrypoint=f"helpers.gateway_agents:{agent}", gateway=gateway, **settings
        ),
        tokenizer,
    )
    loop.bind_run(facts)
    return loop


def run_agent(tokenizer, agent: str, count: int = 2, params=PARAMS, engine=None, **settings):
    """``agent`` on ``count`` samples of the question: (result, engine, loop)."""
    engine = engine or ScriptedEngine(tokenizer)
    loop = gateway_loop(tokenizer, agent, **settings)
    prompt_ids = [loop.prompt_ids(QUESTION)] * count
    rows = [{"prompt": QUESTION, "data_source": "arithmetic"}] * count
    samples = make_samples(prompt_ids, rows, params.seed, [QUESTION] * count)
    try:
        result = run_agent_loops(engine, loop, samples, params, tokenizer)
    finally:
        loop.close()
    return result, engine, loop


def all_trajectories(result) -> list[Trajectory]:
    return [
        t
        for first, more in zip(result.trajectories, result.branches, strict=True)
        for t in (first, *more)
    ]


def trained_runs(traj: Trajectory) -> list[tuple[int, ...]]:
    """The response's runs of mask-1 ids, in order."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(traj.response_ids, traj.response_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return [tuple(run) for run in runs]


def assert_only_sampled_ids_train(result, engine: ScriptedEngine) -> None:
    """Every run of trained ids is a response the engine sampled, each used once."""
    sampled = list(engine.sampled)
    for traj in all_trajectories(result):
        for run in trained_runs(traj):
            assert run in sampled, f"trained ids {run} were never sampled"
            sampled.remove(run)
        generated = [
            lp for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True) if m
        ]
        assert all(lp < 0 for lp in generated)


# --- the interface's example ------------------------------------------------------------------


def test_two_turns_plain_and_streamed_one_branch_observation_untrained(tokenizer):
    result, engine, _ = run_agent(tokenizer, "two_turns")
    assert result.metrics["agent/num_turns/mean"] == 2
    assert result.metrics["agent/branches/mean"] == 1
    assert result.metrics["agent/gateway/requests"] == 4
    assert result.metrics["agent/gateway/stream_requests"] == 2
    assert result.metrics["agent/gateway/errors"] == 0
    assert result.metrics["agent/engine_calls"] == 2  # both sessions' turns batched
    assert_only_sampled_ids_train(result, engine)
    traj = result.trajectories[0]
    observation = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if not m]
    text = tokenizer.decode(observation)
    assert "Observation: 42. Answer again." in text
    untrained_text = tokenizer.decode(
        [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
    )
    assert "Observation" not in untrained_text
    # the whole sequence is what the template renders of the final conversation
    final = [*QUESTION, {"role": "assistant", "content": "19"}]
    final += [{"role": "user", "content": "Observation: 42. Answer again."}]
    final += [{"role": "assistant", "content": "19"}]
    rendered = tokenizer.apply_chat_template(final, tokenize=False)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert traj.answer_text == "19"


def test_client_side_tools_parsed_into_tool_calls_and_replayed_by_meaning(tokenizer):
    result, engine, _ = run_agent(tokenizer, "calculator_tools")
    assert result.metrics["agent/num_turns/mean"] == 2
    assert result.metrics["agent/branches/mean"] == 1  # re-serialised arguments still match
    assert_only_sampled_ids_train(result, engine)
    traj = result.trajectories[0]
    text = tokenizer.decode(traj.token_ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in text  # the agent's tool result
    assert text.count(TOOL_CALL) == 1  # the call as sampled, not re-rendered


# --- branches ------------------------------------------------------------------------------------


def test_compaction_starts_a_second_branch_both_trained_with_the_sessions_reward(tokenizer):
    result, engine, _ = run_agent(tokenizer, "compacting")
    assert result.metrics["agent/branches/mean"] == 2
    assert all(len(more) == 1 for more in result.branches)
    assert_only_sampled_ids_train(result, engine)
    first, second = result.trajectories[0], result.branches[0][0]
    assert first.reward == second.reward == 1.0
    assert "Summary of the work so far." in tokenizer.decode(second.prompt_ids)


def test_a_resent_request_forks_a_sibling_that_trains_only_its_own_tokens(tokenizer):
    result, engine, _ = run_agent(tokenizer, "best_of_two", count=1)
    assert result.metrics["agent/branches/mean"] == 2
    assert result.metrics["agent/gateway/forks"] == 1
    first, sibling = result.trajectories[0], result.branches[0][0]
    assert sibling.prompt_ids == first.prompt_ids
    assert sum(sibling.response_mask) == len(engine.sampled[1])
    assert_only_sampled_ids_train(result, engine)


def test_a_stop_string_ends_the_turn_and_the_next_request_continues_its_tokens(tokenizer):
    """The engine writes past the stop string; the turn is cut after the token that completes
    it (those ids train), the client gets the text before it, and the next request continues
    the cut ids exactly: the template's end-of-turn token is read, not trained."""
    engine = ScriptedEngine(tokenizer, reply=lambda _: "Thought: add. Observation: more text")
    result, _, _ = run_agent(tokenizer, "with_stop", count=1, engine=engine)
    traj = result.trajectories[0]
    assert traj.reward == 1.0 and result.metrics["agent/branches/mean"] == 1
    first = trained_runs(traj)[0]
    assert tokenizer.decode(first).endswith("Observation:")
    assert first == engine.sampled[0][: len(first)] and len(first) < len(engine.sampled[0])
    observation = traj.response_ids[len(first) : len(first) + 1]
    assert observation[0] == engine.end_of_turn and traj.response_mask[len(first)] == 0


def test_a_slow_first_request_holds_back_the_others_only_for_the_first_request_wait(
    tokenizer, monkeypatch
):
    from megarl.agent.gateway import agent_loop

    engine = ScriptedEngine(tokenizer)
    loop = gateway_loop(tokenizer, "slow_starter")
    rows = [{"prompt": QUESTION, "extra_info": {"slow": i == 0}} for i in range(3)]
    samples = make_samples([loop.prompt_ids(QUESTION)] * 3, rows, PARAMS.seed, [QUESTION] * 3)
    try:
        shared = run_agent_loops(engine, loop, samples, PARAMS, tokenizer)
        monkeypatch.setattr(agent_loop, "FIRST_REQUEST_WAIT_S", 0.3)
        split = run_agent_loops(engine, loop, samples, PARAMS, tokenizer)
    finally:
        loop.close()
    assert shared.metrics["agent/engine_calls"] == 1  # all first turns in one call
    # the slow one did not hold the others (a loaded machine may split the rest further)
    assert split.metrics["agent/engine_calls"] >= 2


def test_a_fork_mid_conversation_gets_what_is_left_of_the_context(tokenizer):
    """A retried second request forks at the point before its turn: the sibling reads the
    first turn and the follow-up as its prompt, and its budget is what the context leaves."""
    prompt = len(gateway_loop(tokenizer, "retry_second").prompt_ids(QUESTION))
    limit = prompt + 8
    result, engine, _ = run_agent(tokenizer, "retry_second", count=1, max_prompt_tokens=limit)
    first, sibling = result.trajectories[0], result.branches[0][0]
    assert result.metrics["agent/gateway/forks"] == 1 and first.num_turns == 2
    shared = len(sibling.prompt_ids)
    assert sibling.prompt_ids == first.token_ids[:shared]
    assert shared > prompt  # the first turn and "Again." are context of the sibling
    assert sibling.max_response_tokens == limit + PARAMS.max_new_tokens - shared
    assert_only_sampled_ids_train(result, engine)


# --- other clients -------------------------------------------------------------------------------


def test_anthropic_sdk_plain_and_streamed(tokenizer):
    pytest.importorskip("anthropic")
    result, engine, _ = run_agent(tokenizer, "anthropic_agent")
    assert result.metrics["agent/num_turns/mean"] == 2
    assert result.metrics["agent/branches/mean"] == 1
    assert result.metrics["agent/gateway/stream_requests"] == 2
    assert_only_sampled_ids_train(result, engine)


def test_openai_agents_sdk_with_a_function_tool(tokenizer):
    pytest.importorskip("agents")
    result, engine, _ = run_agent(tokenizer, "agents_sdk", count=1)
    assert result.metrics["agent/num_turns/mean"] == 2  # the call, then the answer
    assert result.metrics["agent/gateway/errors"] == 0
    assert result.metrics["agent/branches/mean"] == 1
    assert_only_sampled_ids_train(result, engine)
    text = tokenizer.decode(result.trajectories[0].token_ids, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in text


# --- errors: the agent's, the requests', the engine's --------------------------------------------


def test_a_wrong_api_key_is_a_401_the_agent_reads(tokenizer):
    with pytest.warns(UserWarning, match="made no request"):
        result, _, _ = run_agent(tokenizer, "wrong_key", count=1)
    assert result.trajectories[0].reward == -1.0
    assert result.metrics["agent/gateway/requests"] == 0  # refused before any session work


def test_requests_that_cannot_be_honoured_are_http_errors_and_the_session_goes_on(tokenizer):
    result, engine, _ = run_agent(tokenizer, "bad_requests", count=1)
    assert result.trajectories[0].reward == 400 + 404 + 400
    assert result.metrics["agent/num_turns/mean"] == 1
    assert_only_sampled_ids_train(result, engine)


@pytest.mark.parametrize("agent", ["crashing", "exiting", "os_exiting"])
def test_a_failing_agent_stops_the_run_in_one_line_under_raise(tokenizer, agent):
    with pytest.raises(
        AgentFailedError, match=r"sample 0 raised (ValueError|SystemExit|os._exit)"
    ) as info:
        run_agent(tokenizer, agent, count=1)
    assert isinstance(info.value, BadInputError)
    assert "gateway_agents.py:" in str(info.value)


@pytest.mark.filterwarnings("ignore:.*made no request")
@pytest.mark.parametrize("agent", ["crashing", "exiting", "os_exiting", "hanging"])
def test_a_failing_agent_scores_zero_under_zero_and_the_step_goes_on(tokenizer, agent):
    with pytest.warns(UserWarning, match="scored 0"):
        result, _, _ = run_agent(
            tokenizer, agent, count=2, reward_error="zero", session_timeout_s=1.0
        )
    assert [t.reward for t in result.trajectories] == [0.0, 0.0]
    assert result.metrics["agent/gateway/agent_errors"] == 2
    assert all(sum(t.response_mask) == 0 for t in result.trajectories)  # nothing trains


def test_an_agent_that_never_calls_keeps_its_reward_and_trains_nothing(tokenizer):
    with pytest.warns(UserWarning, match="made no request"):
        result, _, _ = run_agent(tokenizer, "silent", count=1)
    traj = result.trajectories[0]
    assert traj.reward == 0.5 and sum(traj.response_mask) == 0


def test_an_engine_failure_stops_the_step_not_just_the_agent(tokenizer):
    class Broken(ScriptedEngine):
        def generate_requests(self, requests, params, interrupt=None):
            raise RuntimeError("engine exploded")

    with pytest.raises(RuntimeError, match="engine exploded"):
        run_agent(tokenizer, "two_turns", count=1, engine=Broken(tokenizer))


def test_the_response_budget_ends_with_finish_reason_length_never_an_error(tokenizer):
    engine = ScriptedEngine(tokenizer, reply=lambda _: "one two three four five six seven")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
    result, _, _ = run_agent(tokenizer, "two_turns", count=1, params=params, engine=engine)
    traj = result.trajectories[0]
    assert len(traj.response_ids) == 6 and traj.truncated
    assert result.metrics["agent/gateway/errors"] == 0
    assert result.metrics["agent/num_turns/mean"] == 1  # the second request had no room


def test_entrypoint_errors_are_one_line_bad_input(tokenizer):
    with pytest.raises(AgentLoopError, match="entrypoint is not set"):
        GatewayLoop(AgentSettings(loop="openai"), tokenizer)
    with pytest.raises(AgentLoopError, match="module 'no_such_agents' not found"):
        GatewayLoop(AgentSettings(loop="openai", entrypoint="no_such_agents:solve"), tokenizer)
    with pytest.raises(AgentLoopError, match="has no function 'nope'"):
        GatewayLoop(
            AgentSettings(loop="openai", entrypoint="helpers.gateway_agents:nope"), tokenizer
        )


# --- the protocol on plain data -----------------------------------------------------------------


def test_openai_requests_as_real_clients_send_them():
    body = {
        "model": "megarl-policy",
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "2+3?"},
            {**tool_call_message("add", '{"a": 2, "b": 3}'), "refusal": None},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        "tools": [{**CALCULATOR_STRICT}],
        "tool_choice": "required",
        "max_completion_tokens": 9,
        "stream": False,
        "stop": ["Observation:"],
    }
    request = parse_openai(body)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert request.messages[0].content == "Be brief."
    assert request.messages[2].tool_calls[0].arguments == {"a": 2, "b": 3}
    compact = parse_openai(
        {
            **body,
            "messages": [
                {
                    **body["messages"][2],
                    "tool_calls": [{"function": {"name": "add", "arguments": '{"b":3,"a":2}'}}],
                }
            ],
        }
    )
    assert compact.messages[0].meaning == request.messages[2].meaning
    assert request.max_tokens == 9 and request.stop == ("Observation:",)
    assert request.tool_names == ("add",)


CALCULATOR_STRICT = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "title": "A"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=2"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
    ],
)
def test_openai_requests_the_gateway_refuses_say_why(body, message):
    with pytest.raises(GatewayError, match=message) as info:
        parse_openai(body)
    assert info.value.status == 400


def test_anthropic_tool_results_become_tool_messages_in_order():
    request = parse_anthropic(
        {
            "model": "megarl-policy",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "2+3?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me add."},
                        {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "5"},
                        {"type": "text", "text": "Go on."},
                    ],
                },
            ],
            "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        }
    )
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert request.messages[2].tool_calls[0].arguments == {"a": 2, "b": 3}
    assert request.messages[3].content == "5" and request.messages[4].content == "Go on."


# --- the standalone gateway ---------------------------------------------------------------------


def test_standalone_gateway_serves_sessions_on_first_use(tokenizer):
    import openai

    engine = ScriptedEngine(tokenizer)
    server = serve(engine, tokenizer)
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/sessions/debug/v1", api_key=server.api_key, max_retries=0
        )
        assert [m.id for m in client.models.list()] == ["megarl-policy"]
        reply = client.chat.completions.create(
            model="megarl-policy", messages=QUESTION, logprobs=True, temperature=0
        )
        assert reply.choices[0].message.content == "19"
        assert reply.usage.completion_tokens == len(engine.sampled[0])
        assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(
            [-(j + 1) / 100 for j in range(len(engine.sampled[0]))]
        )
        session = server.sessions_by_id["debug"]
        assert len(session.trajectories()) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{server.url}/sessions/x/v1", api_key="bad", max_retries=0
            ).models.list()
    finally:
        server.close()

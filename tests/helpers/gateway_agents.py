"""Agents written as their authors write them, against the real SDKs, unmodified: what the
gateway's tests (``rollout.agent.entrypoint=helpers.gateway_agents:<name>``) train and serve."""

from __future__ import annotations

import asyncio
import json
import sys
import time

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def _answered_then(client, llm, row, follow_up: str, **request):
    """The row's prompt sent once (``request``: the call's other arguments), then the reply
    and the user's ``follow_up`` appended, as a chat agent's second request carries them.
    Returns that conversation and the first completion."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model=llm.model, messages=messages, **request)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": follow_up},
    ]
    return messages, first


async def two_turns(row, llm):
    """The interface's example: a plain call, an observation, a streamed call."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages, _ = await _answered_then(
        client, llm, row, "Observation: 42. Answer again.", max_tokens=16
    )
    stream = await client.chat.completions.create(
        model=llm.model, messages=messages, max_tokens=16, stream=True
    )
    async for _ in stream:
        pass
    return


def calculator_tools(row, llm):
    """A synchronous agent with a client-side tool, replaying turns as LangChain does
    (arguments re-serialised with spaces, ``content: None`` on tool-call turns)."""
    import openai

    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages = list(row["prompt"])
    for _ in range(3):
        reply = client.chat.completions.create(
            model=llm.model, messages=messages, tools=[CALCULATOR], max_completion_tokens=48
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            return
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": json.dumps(json.loads(call.function.arguments), indent=None),
                },
            }
            for call in message.tool_calls
        ]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}
            )
    return


async def compacting(row, llm):
    """Answers once, then starts over with a summary in place of the conversation (what
    context compaction does): the second conversation extends nothing recorded."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    first = await client.chat.completions.create(
        model=llm.model, messages=row["prompt"], max_tokens=8
    )
    summary = [
        {"role": "system", "content": "Summary of the work so far."},
        {"role": "user", "content": f"Earlier you said: {first.choices[0].message.content}"},
    ]
    await client.chat.completions.create(model=llm.model, messages=summary, max_tokens=8)
    return 1.0


async def best_of_two(row, llm):
    """The same request twice (a retry, or best-of-n): two siblings of one prompt."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    for _ in range(2):
        await client.chat.completions.create(model=llm.model, messages=row["prompt"], max_tokens=8)
    return


async def anthropic_agent(row, llm):
    """The Anthropic SDK: a system prompt, a plain call, then a streamed one."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=llm.anthropic_base_url, api_key=llm.api_key)
    system = next((m["content"] for m in row["prompt"] if m["role"] == "system"), None)
    messages = [m for m in row["prompt"] if m["role"] != "system"]
    kwargs = {"system": system} if system else {}
    first = await client.messages.create(
        model=llm.model, max_tokens=16, messages=messages, **kwargs
    )
    messages = [
        *messages,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": "Once more, please."},
    ]
    async with client.messages.stream(
        model=llm.model, max_tokens=16, messages=messages, **kwargs
    ) as stream:
        await stream.get_final_message()
    return


async def agents_sdk(row, llm):
    """The OpenAI Agents SDK through its chat-completions model, with a function tool."""
    import openai
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    agent = Agent(
        name="calculator",
        instructions="Answer with just the number.",
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        tools=[add],
    )
    question = row["prompt"][-1]["content"]
    await Runner.run(agent, question, max_turns=3)
    return


async def wrong_key(row, llm):
    """A request with a wrong API key: the SDK raises AuthenticationError; the agent reports
    it as its reward's sign and goes on."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key="not-the-key", max_retries=0)
    try:
        await client.chat.completions.create(model=llm.model, messages=row["prompt"])
    except openai.AuthenticationError:
        return -1.0
    return 1.0


async def bad_requests(row, llm):
    """Requests the gateway cannot honour, each an error the agent reads; then a good one."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    errors = []
    for kwargs in ({"n": 2}, {"model": "gpt-unknown"}, {"messages": []}):
        request = {"model": llm.model, "messages": row["prompt"], "max_tokens": 4, **kwargs}
        try:
            await client.chat.completions.create(**request)
        except openai.APIStatusError as exc:
            errors.append(exc.status_code)
    await client.chat.completions.create(model=llm.model, messages=row["prompt"], max_tokens=4)
    return float(sum(errors))


def crashing(row, llm):
    raise ValueError("the agent's own bug")


def exiting(row, llm):
    """``unittest.main()`` in an agent: SystemExit(0) must not end the run as a success."""
    sys.exit(0)


def hanging(row, llm):
    time.sleep(3600)


async def silent(row, llm):
    """Never calls the model."""
    await asyncio.sleep(0)
    return 0.5


async def slow_starter(row, llm):
    """Prepares for a while before its first request (sample 0 only)."""
    import openai

    if row.get("extra_info", {}).get("slow"):
        await asyncio.sleep(1.0)
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    await client.chat.completions.create(model=llm.model, messages=row["prompt"], max_tokens=4)
    return


async def with_stop(row, llm):
    """A stop string (as smolagents sends ``Observation:``), then the conversation goes on."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages, first = await _answered_then(
        client, llm, row, "Observation: 5", max_tokens=16, stop=["Observation:"]
    )
    await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=16)
    return 1.0 if first.choices[0].finish_reason == "stop" else 0.0


async def retry_second(row, llm):
    """Two turns, the second request sent twice (a retry): a sibling forked mid-conversation."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages, _ = await _answered_then(client, llm, row, "Again.", max_tokens=8)
    for _ in range(2):
        await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=8)
    return


def os_exiting(row, llm):
    """``os._exit`` in an agent: the sample's failure, never the trainer process's end."""
    import os

    os._exit(0)

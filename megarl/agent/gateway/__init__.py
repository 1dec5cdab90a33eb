"""The agent gateway: OpenAI- and Anthropic-compatible HTTP over the rollout engine, so an
agent written for those APIs trains unmodified.

Training (``rollout.agent.loop=openai``, ``rollout.agent.entrypoint=package.module:solve``):
each sample calls the user's ``solve(row, llm)`` once (:mod:`.agent_loop`); ``llm.base_url``
is a base URL of that sample's own **session**, so any client works without custom headers::

    async def solve(row, llm):
        client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
        reply = await client.chat.completions.create(model=llm.model, messages=row["prompt"])
        return None  # the dataset's reward scores the session's last answer

The pieces, each in its own module:

* :mod:`.protocol` -- the two APIs' requests and answers to and from one neutral form (pure);
* :mod:`.sessions` -- a session's requests placed on **branches**, token-exact trajectories:
  the gateway renders the messages with the chat template itself and reuses the ids it
  sampled wherever the history holds an assistant turn it served (matched by meaning), so
  generated tokens are never re-tokenised; a history that no longer extends a branch (context
  compaction, a sub-agent, an edited turn) starts a new one. Each branch trains as a sequence
  of its own, only its sampled tokens with mask 1, all with the session's reward;
* :mod:`.server` -- the HTTP server (aiohttp on a thread of its own, for the whole run), its
  routes, the run's random API key;
* :mod:`.agent_loop` -- the agent loop that runs the user's function per sample, bounded in
  time, its failures handled by ``data.reward_error``.

Without training, to debug an agent against a model (the same sessions, one per base URL, over
an engine you built)::

    from megarl.agent.gateway import serve
    server = serve(engine, tokenizer, port=8000)   # prints nothing, returns once listening
    # base_url = f"{server.url}/sessions/debug/v1", api_key = server.api_key
    ...
    server.close()

Each request's ``temperature`` and ``top_p`` are honoured there; in training the run's
``rollout.temperature``/``top_p`` apply (the trainer's logprobs are computed at them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megarl.agent.gateway.protocol import ChatRequest, GatewayError, Message, Reply
from megarl.agent.gateway.server import MODEL_NAME, GatewayServer
from megarl.agent.gateway.sessions import Session
from megarl.agent.gateway.settings import GatewaySettings

if TYPE_CHECKING:
    from megarl.engines.base import RolloutEngine

__all__ = [
    "MODEL_NAME",
    "ChatRequest",
    "GatewayError",
    "GatewayServer",
    "GatewaySettings",
    "Message",
    "Reply",
    "Session",
    "serve",
]


def serve(
    engine: RolloutEngine,
    tokenizer: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    max_new_tokens: int = 512,
    temperature: float = 1.0,
    tool_format: str = "hermes",
) -> GatewayServer:
    """A standalone gateway over ``engine`` (no training): every session id a client uses in
    its base URL (``/sessions/<id>/v1``) gets a session on first use. Requests are sampled one
    engine call each, at the request's ``temperature``/``top_p`` (``temperature`` here is the
    default), each session's branches kept in ``server.sessions_by_id`` for inspection.
    Returns the started server; ``server.close()`` stops it."""
    from megarl.agent.gateway.standalone import StandaloneSessions

    sessions = StandaloneSessions(engine, tokenizer, max_new_tokens, temperature, tool_format)
    return GatewayServer(host, port, api_key, session_factory=sessions.new_session).start()

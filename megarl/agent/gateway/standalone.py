"""A gateway without training: sessions made on first use, each request one engine call.

For debugging an agent against a model (:func:`megarl.agent.gateway.serve`): the same
sessions and branches as in training, but each request is sampled at its own ``temperature``
and ``top_p`` (the server's default temperature where it gives none) from a fresh seed, and
nothing batches requests of different sessions together.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from megarl.agent.driver import generate_output
from megarl.agent.gateway.protocol import ChatRequest
from megarl.agent.gateway.sessions import Session, tools_key
from megarl.agent.render import ChatRenderer
from megarl.agent.trajectory import GenerateOutput
from megarl.engines.base import Request, RolloutEngine, SamplingParams


class StandaloneSessions:
    """Makes the sessions of a standalone gateway and samples their turns."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        max_new_tokens: int,
        temperature: float,
        tool_format: str,
    ) -> None:
        self.engine, self.tokenizer, self.tool_format = engine, tokenizer, tool_format
        self.params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        self._renderers: dict[str, ChatRenderer] = {}
        self._engine_lock = asyncio.Lock()

    def renderer_for(self, tools: Sequence[Mapping[str, Any]]) -> ChatRenderer:
        key = tools_key(tools)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools, tool_format=self.tool_format)
        return self._renderers[key]

    def new_session(self, session_id: str) -> Session:
        return Session(self.generate, self.renderer_for, self.params.max_new_tokens)

    async def generate(
        self, ids: Sequence[int], limit: int, request: ChatRequest
    ) -> GenerateOutput:
        """One engine call for one request, at the request's sampling (one call at a time)."""
        params = replace(
            self.params,
            temperature=self.params.temperature
            if request.temperature is None
            else request.temperature,
            top_p=1.0 if request.top_p in (None, 0.0) else request.top_p,
            max_new_tokens=limit,
        )
        engine_request = Request(tuple(int(t) for t in ids), secrets.randbits(63))
        async with self._engine_lock:
            generations = await asyncio.to_thread(
                self.engine.generate_requests, [engine_request], params
            )
        return generate_output(generations[0], limit)

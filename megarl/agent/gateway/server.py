"""The gateway's HTTP side: an aiohttp server on a thread of its own, for the whole run.

Why a thread and not the step's event loop: a step's agent loops run on an event loop that
lives for one step (:func:`megarl.agent.driver.run_agent_loops`), while an agent may sit in
another process or on another node and must find the same address at every step, between
steps (a straggler gets a clear 410, not a refused connection), and during validation. So the
server owns a loop on a daemon thread; each request is handed to its session's own loop (the
step's, where the batcher lives) with :func:`asyncio.run_coroutine_threadsafe`, and the answer
comes back the same way. Nothing the server does can block a step: a slow client holds only its
own connection.

Routes (``{sid}``: the session id in the agent's base URL):

* ``POST /sessions/{sid}/v1/chat/completions`` -- OpenAI Chat Completions, whole or streamed;
* ``POST /sessions/{sid}/v1/messages`` -- Anthropic Messages, whole or streamed;
* ``GET /v1/models``, ``GET /sessions/{sid}/v1/models`` -- the one served model.

Every request needs the run's API key (``Authorization: Bearer <key>`` as the OpenAI SDK sends
it, or ``x-api-key`` as the Anthropic SDK does): 401 otherwise. Every error carries
``x-should-retry: false`` so that SDKs do not retry what cannot succeed, and a message in the
API's own error shape.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.agent.gateway.protocol import (
    ChatRequest,
    GatewayError,
    anthropic_error,
    anthropic_response,
    anthropic_stream,
    openai_error,
    openai_response,
    openai_stream,
    parse_anthropic,
    parse_openai,
)

if TYPE_CHECKING:
    from aiohttp import web

    from megarl.agent.gateway.sessions import Session

MODEL_NAME = "megarl-policy"
"""The served model's name (what ``llm.model`` says); deliberately not one that client
libraries route to another API (LangChain sends ``*codex*`` names to the Responses API)."""


@dataclass(frozen=True)
class _Registered:
    session: Session
    loop: asyncio.AbstractEventLoop


class GatewayServer:
    """The run's gateway endpoint. :meth:`start` binds (``port`` 0: a free one) and returns once
    it listens; :meth:`register` makes a session reachable under its own base URL.

    ``session_factory``: for a standalone gateway (debugging an agent without training),
    builds a session on the server's loop for an unknown session id; None (training): an
    unknown id is a 404."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_name: str = MODEL_NAME,
        session_factory: Callable[[str], Session] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.api_key = api_key or f"megarl-{secrets.token_hex(16)}"
        self.model_name = model_name
        self.session_factory = session_factory
        self._sessions: dict[str, _Registered] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # --- life ---------------------------------------------------------------------------------

    def start(self) -> GatewayServer:
        """Listen (on a daemon thread); raises what binding raised (e.g. the port is taken)."""
        if self._thread is not None:
            return self
        started: Future[int] = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(started,), name="megarl-gateway", daemon=True
        )
        self._thread.start()
        self.port = started.result(timeout=60)
        return self

    def _serve(self, started: Future[int]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen(started))
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            if not started.done():
                started.set_exception(exc)
            return
        loop.run_forever()
        loop.run_until_complete(self._shutdown())
        loop.close()

    async def _listen(self, started: Future[int]) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat_completions)
        app.router.add_post("/sessions/{sid}/v1/messages", self._messages)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addresses = self._runner.addresses
        started.set_result(addresses[0][1] if addresses else self.port)

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def close(self) -> None:
        """Stop listening (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)

    # --- sessions -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def session_url(self, session_id: str) -> str:
        """The session's base, ``.../sessions/<id>`` (the Anthropic SDK's ``base_url``; the
        OpenAI SDK's is this plus ``/v1``)."""
        return f"{self.url}/sessions/{session_id}"

    def register(self, session: Session, loop: asyncio.AbstractEventLoop) -> str:
        """Make ``session`` reachable; its requests run on ``loop``. Returns its id."""
        session_id = uuid.uuid4().hex
        with self._lock:
            self._sessions[session_id] = _Registered(session, loop)
        return session_id

    @property
    def sessions_by_id(self) -> dict[str, Session]:
        """The sessions reachable now, by id (a standalone gateway's: every one used)."""
        with self._lock:
            return {sid: found.session for sid, found in self._sessions.items()}

    def unregister(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def _session(self, session_id: str) -> _Registered:
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None and self.session_factory is not None:
                assert self._loop is not None
                found = _Registered(self.session_factory(session_id), self._loop)
                self._sessions[session_id] = found
        if found is None:
            raise GatewayError(
                404, f"no session {session_id!r}: it has ended or never existed", "not_found_error"
            )
        return found

    # --- handlers -----------------------------------------------------------------------------

    def _authorise(self, request: web.Request) -> None:
        given = request.headers.get("x-api-key", "")
        bearer = request.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            given = given or bearer[len("Bearer ") :]
        if not secrets.compare_digest(given.strip(), self.api_key):
            raise GatewayError(401, "invalid API key", "authentication_error")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authorise(request)
        except GatewayError as error:
            return _error_response(error, openai_error)
        from aiohttp import web

        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "megarl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_openai, openai_error, "openai")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_anthropic, anthropic_error, "anthropic")

    async def _complete(
        self,
        request: web.Request,
        parse: Callable[[Any], ChatRequest],
        error_body: Callable[[GatewayError], dict[str, Any]],
        api: str,
    ) -> web.StreamResponse:
        try:
            self._authorise(request)
            registered = self._session(request.match_info["sid"])
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise GatewayError(400, f"the request body is not JSON: {exc}") from None
            chat = parse(body)
            if chat.model and chat.model != self.model_name:
                raise GatewayError(
                    404,
                    f"the model {chat.model!r} does not exist here: use {self.model_name!r}",
                    "not_found_error",
                )
            reply = await _on_loop(registered, chat)
        except GatewayError as error:
            return _error_response(error, error_body)
        if chat.stream:
            if api == "openai":
                events = openai_stream(reply, self.model_name, chat.logprobs)
            else:
                events = anthropic_stream(reply, self.model_name)
            return await _event_stream(request, events)
        from aiohttp import web

        if api == "openai":
            return web.json_response(openai_response(reply, self.model_name, chat.logprobs))
        return web.json_response(anthropic_response(reply, self.model_name))


async def _on_loop(registered: _Registered, chat: ChatRequest):
    """Run ``session.complete`` on the session's loop and wait for it here."""
    try:
        future = asyncio.run_coroutine_threadsafe(
            registered.session.complete(chat), registered.loop
        )
    except RuntimeError:  # the step's loop has closed: the session is over
        raise GatewayError(410, "this session has ended (its sample is done)") from None
    return await asyncio.wrap_future(future)


def _error_response(
    error: GatewayError, body: Callable[[GatewayError], dict[str, Any]]
) -> web.StreamResponse:
    from aiohttp import web

    return web.json_response(body(error), status=error.status, headers={"x-should-retry": "false"})


async def _event_stream(request: web.Request, events: Iterator[str]) -> web.StreamResponse:
    from aiohttp import web

    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for event in events:
        await response.write(event.encode())
    await response.write_eof()
    return response

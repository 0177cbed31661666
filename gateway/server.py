"""The gateway's server: OpenAI's HTTP API on 127.0.0.1, one session per rollout.

`Gateway.running()` serves an ASGI app (Starlette on uvicorn) as a task of the caller's event
loop, for as long as the `async with` lasts: the trainer's loop, so each call goes straight to
the rollout's engine with no thread hop. `gateway.session(engine)` opens one rollout's endpoint:

    POST {base_url}/chat/completions    POST {base_url}/completions    GET {base_url}/models

with `base_url = http://127.0.0.1:<port>/sessions/<id>/v1` and a key of its own (`Authorization:
Bearer <key>`); closing it cancels the calls in flight and answers later ones 404. Every error
is OpenAI's error JSON with a 4xx or 5xx, never a dropped connection.

`Gateway.serving()` is the hook a workflow that needs a gateway declares (`AgentWorkflow`): the
trainer enters it around its rollouts (`unified.rollout.workflow_serving`); nested, it reuses the
gateway already running in this context.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.api import (
    ChatRequest,
    CompletionRequest,
    GatewayError,
    chat_chunks,
    error_body,
    first_error,
)
from gateway.session import AgentSession
from unified.errors import UsageError
from unified.protocol import RolloutEngine

__all__ = ["Gateway", "shared_gateway"]

_M = TypeVar("_M", ChatRequest, CompletionRequest)
_CURRENT: ContextVar[Gateway | None] = ContextVar("unified_gateway", default=None)
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the trainer owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    """OpenAI-compatible endpoints for the rollouts of one process; see the module docstring."""

    def __init__(self, host: str, port: int, model: str = "policy") -> None:
        self.host = host
        self.port = port
        self.model = model
        self.sessions: dict[str, AgentSession] = {}
        self.app = Starlette(
            routes=[
                Route("/sessions/{sid}/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/sessions/{sid}/v1/completions", self._complete, methods=["POST"]),
                Route("/sessions/{sid}/v1/models", self._models, methods=["GET"]),
            ],
            exception_handlers={
                GatewayError: _error_response,
                404: _not_found,
                405: _not_allowed,
                Exception: _server_error,
            },
        )

    @classmethod
    @contextlib.asynccontextmanager
    async def serving(cls) -> AsyncIterator[Gateway]:
        """The gateway of this context, started on 127.0.0.1 if none runs yet."""
        gateway = _CURRENT.get()
        if gateway is not None:
            yield gateway
            return
        async with cls.running() as gateway:
            token = _CURRENT.set(gateway)
            try:
                yield gateway
            finally:
                _CURRENT.reset(token)

    @classmethod
    @contextlib.asynccontextmanager
    async def running(cls, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[Gateway]:
        """Serve on `host:port` (0: a free port) until the block ends."""
        try:
            sock = socket.create_server((host, port))
            # Accepted sockets inherit it. asyncio sets it only on sockets made with proto TCP
            # (create_server's are proto 0): without it a reply's header and body wait on the
            # client's delayed ACK, 40 ms a call.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise UsageError(
                f"the gateway cannot listen on {host}:{port} ({e}); pick another port"
            ) from None
        gateway = cls(host, sock.getsockname()[1])
        config = uvicorn.Config(
            gateway.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(_STOP_TIMEOUT_S),
        )
        server = _Server(config)
        try:
            async with asyncio.TaskGroup() as tg:
                serve = tg.create_task(server.serve(sockets=[sock]))
                try:
                    await _started(server, serve)
                    yield gateway
                finally:
                    for session in list(gateway.sessions.values()):
                        session.close()
                    server.should_exit = True
        finally:
            sock.close()

    @contextlib.asynccontextmanager
    async def session(
        self, engine: RolloutEngine, *, declare_tools: bool = True
    ) -> AsyncIterator[AgentSession]:
        """One rollout's endpoint, served by `engine` until the block ends (`declare_tools`:
        see `AgentSession`)."""
        session_id = secrets.token_hex(8)
        key = "sk-" + secrets.token_urlsafe(24)
        session = AgentSession(session_id, key, engine, self.model, declare_tools=declare_tools)
        self.sessions[session_id] = session
        try:
            yield session
        finally:
            session.close()
            del self.sessions[session_id]

    def base_url(self, session: AgentSession) -> str:
        """Where the `openai` client of `session`'s agent points (`base_url=`)."""
        return f"http://{self.host}:{self.port}/sessions/{session.id}/v1"

    def _session(self, request: Request) -> AgentSession:
        session = self.sessions.get(request.path_params["sid"])
        if session is None:
            raise GatewayError(404, "no such session: it ended, or the URL is wrong")
        if request.headers.get("authorization") != f"Bearer {session.api_key}":
            raise GatewayError(401, "wrong API key for this session", kind="authentication_error")
        return session

    async def _chat(self, request: Request) -> Response:
        session = self._session(request)
        chat = _parsed(ChatRequest, await _body(request))
        completion = await session.chat(chat)
        if chat.stream:
            options = chat.model_extra.get("stream_options") if chat.model_extra else None
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            events = chat_chunks(completion, include_usage=usage)
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return JSONResponse(completion)

    async def _complete(self, request: Request) -> Response:
        session = self._session(request)
        completion_request = _parsed(CompletionRequest, await _body(request))
        if completion_request.stream:
            raise GatewayError(400, "stream: served for chat completions only", param="stream")
        return JSONResponse(await session.complete(completion_request))

    async def _models(self, request: Request) -> Response:
        self._session(request)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "unified"}
        return JSONResponse({"object": "list", "data": [model]})


def shared_gateway() -> contextlib.AbstractAsyncContextManager[Gateway]:
    """`Gateway.serving()` as a module-level function, which pickles by reference: what
    `AgentWorkflow.serving` names, so the workflow travels to Ray rollout workers."""
    return Gateway.serving()


async def _started(server: uvicorn.Server, serve: asyncio.Task[None]) -> None:
    """Wait until uvicorn serves (it has no event for it), at most `_START_TIMEOUT_S`."""
    async with asyncio.timeout(_START_TIMEOUT_S):
        while not server.started:
            if serve.done():
                raise UsageError("the gateway's server stopped while starting")
            await asyncio.sleep(0.002)


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not JSON") from None


def _parsed(model: type[_M], body: Any) -> _M:
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise first_error(e) from None


async def _error_response(request: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    return JSONResponse(error_body(error), status_code=error.status)


async def _not_found(request: Request, error: Exception) -> Response:
    return await _error_response(request, GatewayError(404, f"no route {request.url.path}"))


async def _not_allowed(request: Request, error: Exception) -> Response:
    message = f"{request.method} is not served on {request.url.path}"
    return await _error_response(request, GatewayError(405, message))


async def _server_error(request: Request, error: Exception) -> Response:
    message = f"the gateway failed: {type(error).__name__}: {error}"
    return JSONResponse(error_body(GatewayError(500, message)), status_code=500)

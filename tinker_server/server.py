"""`unified tinker-serve`: a Tinker-compatible HTTP server backed by the torch kit.

The unmodified `tinker` SDK talks to it (`ServiceClient(base_url="http://127.0.0.1:8000")`):
sessions and heartbeats, create_model (LoRA of the requested rank), get_info (the tokenizer is a
local directory), forward / forward_backward (protobuf), optim_step, save/load weights and state
(`tinker://` paths in a local store), sampling sessions and asample (protobuf), retrieve_future
(long-polled), finish. Work requests are answered with a future at once; their failures are error
futures, never dropped connections. Loopback by default; `--api-key` makes every request carry
that key. `LocalServer` runs the same app on a background thread for tests and examples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from tinker_server.faults import FaultInjector, Faults
from tinker_server.futures import FutureStore, Outcome
from tinker_server.rest import FILES_PREFIX, add_rest_routes
from tinker_server.service import ENGINES, LocalTinker
from tinker_server.training import UserError
from tinker_server.wire import WireError, decode_forward_backward
from torchkit.vllm_settings import VllmSettings
from unified.commands import run_command
from unified.errors import UsageError
from unified.model_provider import resolve_model_spec

__all__ = ["DEFAULT_STORE", "LocalServer", "create_app", "main"]

DEFAULT_STORE = Path(".cache/tinker-store")

START_TIMEOUT_S = {"builtin": 120.0, "vllm": 900.0}
"""How long `tinker-serve` waits for its model and engine to load: vLLM's start took 20-60 s
alone on 2 cores, and more than 120 s on a busy host (then the server gave up mid-start)."""

log = logging.getLogger(__name__)
_Settings = TypeVar("_Settings", bound=BaseModel)


def create_app(
    service: LocalTinker,
    *,
    api_key: str | None = None,
    faults: Faults | None = None,
    ready: threading.Event | None = None,
) -> FastAPI:
    """The ASGI app serving `service`; `ready` is set once the model is loaded (or failed to:
    then `app.state.load_error` holds why, and the waiter stops the server)."""
    futures = FutureStore()
    injector = FaultInjector(faults or Faults())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with asyncio.TaskGroup() as tasks:
                futures.open(tasks)
                try:
                    await asyncio.to_thread(service.load)
                    await service.warm_up()
                except Exception as e:
                    app.state.load_error = e
                    if ready is None:
                        raise
                    # Whoever waits on `ready` reports it in one line and stops the server
                    # (`LocalServer.start`); raised here, uvicorn would print its traceback.
                finally:
                    if ready is not None:
                        ready.set()
                yield
                futures.cancel_all()
        finally:  # every request has ended: the sampling engine can go
            await asyncio.to_thread(service.close)

    app = FastAPI(title="unified tinker-serve", lifespan=lifespan)
    app.state.injector = injector
    app.state.futures = futures  # tests shorten its long poll
    app.state.load_error = None
    app.add_middleware(_Guard, api_key=api_key, injector=injector)

    def submit(path: str, work: Callable[[], Awaitable[Outcome]]) -> str:
        """Start `work` as a future; a wrong request becomes a `user` error future."""

        async def guarded() -> Outcome:
            try:
                outcome = await work()
            except (UserError, WireError, KeyError, TypeError, ValueError) as e:
                outcome = Outcome(error=f"{type(e).__name__}: {e}", category="user")
            return injector.future_outcome(path, outcome)

        return futures.submit(path.rsplit("/", 1)[-1], guarded)

    def future(path: str, work: Callable[[], Awaitable[Outcome]]) -> JSONResponse:
        return JSONResponse({"request_id": submit(path, work)})

    async def body(request: Request) -> dict[str, Any]:
        payload = await request.json()
        if not isinstance(payload, dict):
            raise UserError("request body must be a JSON object")
        return payload

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": name} for name in service.advertised]}

    @app.post("/api/v1/create_session")
    async def create_session() -> dict[str, Any]:
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat() -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        try:  # the SDK sends {"reason": {"type": status}, "detail": ...}; be lenient
            body = json.loads(await request.body() or b"{}")
            status, detail = str(body["reason"]["type"]), body.get("detail")
        except (ValueError, KeyError, TypeError, AttributeError):
            status, detail = "unknown", None
        service.finish_session(session_id, status)
        log.info("session %s finished: %s%s", session_id, status, f" ({detail})" if detail else "")
        return Response(status_code=200)

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> JSONResponse:
        payload = await body(request)
        return future("/api/v1/create_model", lambda: service.create_model(payload))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> JSONResponse:
        payload = await body(request)
        try:
            return JSONResponse(service.get_info(str(payload.get("model_id"))))
        except UserError as e:
            return JSONResponse({"detail": str(e)}, 404)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> JSONResponse:
        raw = await request.body()

        async def work() -> Outcome:
            return await service.forward_backward(decode_forward_backward(raw))

        return future("/api/v1/forward_backward", work)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> JSONResponse:
        payload = await body(request)
        return future("/api/v1/optim_step", lambda: service.optim_step(payload))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> JSONResponse:
        payload = await body(request)
        return future("/api/v1/save_weights", lambda: service.save_weights(payload, kind="weights"))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> JSONResponse:
        payload = await body(request)
        if payload.get("path"):
            work = lambda: service.save_weights(payload, kind="sampler_weights")  # noqa: E731
        else:
            work = lambda: service.snapshot_for_sampler(payload)  # noqa: E731
        return future("/api/v1/save_weights_for_sampler", work)

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> JSONResponse:
        payload = await body(request)
        return future(
            "/api/v1/save_weights_external", lambda: service.save_weights_external(payload)
        )

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> JSONResponse:
        payload = await body(request)
        return future("/api/v1/load_weights", lambda: service.load_weights(payload))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> JSONResponse:
        payload = await body(request)
        try:
            session_id = await service.create_sampling_session(payload)
        except UserError as e:
            return JSONResponse({"detail": str(e)}, 422)
        return JSONResponse({"type": "create_sampling_session", "sampling_session_id": session_id})

    @app.get("/api/v1/samplers/{sampler_id}")
    async def sampler_info(sampler_id: str) -> dict[str, Any]:
        return {"sampler_id": sampler_id, "base_model": service.model_spec, "model_path": None}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> JSONResponse:
        payload = await body(request)
        request_id = submit("/api/v1/asample", lambda: service.sample(payload))
        count = int(payload.get("num_samples", 1))
        # One id per sample, as the service gives (the SDK stamps them on the sequences).
        sequence_ids = [f"{request_id}:{i}" for i in range(count)]
        return JSONResponse({"request_id": request_id, "sample_sequence_ids": sequence_ids})

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        payload = await body(request)
        request_id = str(payload.get("request_id"))
        try:
            outcome = await futures.retrieve(request_id)
        except KeyError:
            return JSONResponse({"detail": f"future {request_id!r} not found"}, 404)
        if outcome is None:  # 408, as the service: the SDK polls again without a warning
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408
            )
        if outcome.error is not None:
            return JSONResponse({"error": outcome.error, "category": outcome.category})
        return Response(outcome.body, media_type=outcome.media_type)

    add_rest_routes(app, service)
    return app


class _Guard:
    """The API key check and injected HTTP faults, as plain ASGI middleware.

    Plain ASGI rather than `@app.middleware("http")`, which streams every response through an
    extra task: on the sampling path (two requests per rollout) that cost shows in step time.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, injector: FaultInjector) -> None:
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.injector = injector

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal: Response | None = None
        signed = scope["path"].startswith(FILES_PREFIX)  # the signed URL is the credential
        if (
            self.key is not None
            and not signed
            and dict(scope["headers"]).get(b"x-api-key") != self.key
        ):
            refusal = JSONResponse({"detail": "invalid or missing API key (X-API-Key)"}, 401)
        else:
            path = scope["path"]
            delay = self.injector.latency_for(path)
            if delay:
                await asyncio.sleep(delay)
            status = self.injector.status_for(path)
            if status is not None:
                refusal = JSONResponse({"detail": f"injected HTTP {status}"}, status)
        if refusal is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


class LocalServer:
    """The server on a background thread: `with LocalServer("builtin:tiny") as url: ...`."""

    def __init__(
        self,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        store: Path = DEFAULT_STORE,
        api_key: str | None = None,
        faults: Faults | None = None,
        max_batch: int = 64,
        keep_samplers: int = 8,
        aliases: Sequence[str] = (),
        engine: str = "builtin",
        vllm: VllmSettings | None = None,
    ) -> None:
        self.service = LocalTinker(
            model,
            store,
            max_batch=max_batch,
            keep_samplers=keep_samplers,
            aliases=aliases,
            engine=engine,
            vllm=vllm,
        )
        self._ready = threading.Event()
        self.app = create_app(self.service, api_key=api_key, faults=faults, ready=self._ready)
        try:
            self._socket = socket.create_server((host, port))
        except OSError as e:
            raise UsageError(
                f"the local Tinker server cannot listen on {host}:{port} "
                f"({os.strerror(e.errno) if e.errno else e}); pick "
                "another port (0 picks a free one)"
            ) from None
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="tinker-serve", daemon=True)
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        """Where the SDK reaches the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def injected(self) -> dict[str, int]:
        """How many faults of each kind the server injected so far."""
        injector: FaultInjector = self.app.state.injector
        return dict(injector.injected)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 120.0) -> str:
        """Start serving and wait (at most `timeout_s`) for the model to load; the base URL."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            # The load cannot be interrupted: once it ends, the server stops and frees what it
            # started (a vLLM engine left running would keep this process from exiting).
            self._server.should_exit = True
            raise TimeoutError(f"the local Tinker server did not load within {timeout_s:g} s")
        error = self._error or self.app.state.load_error
        if error is not None or not self._thread.is_alive():
            self.stop()
            # Ours (a bad --vllm setting, a missing model) read as they are.
            detail = str(error) if isinstance(error, UsageError) else repr(error)
            raise UsageError(f"the local Tinker server failed to start: {detail}")
        return self.base_url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving and wait (at most `timeout_s`) for the thread to end."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C in the calling thread interrupts it)."""
        self._thread.join()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_at_eof(server: LocalServer) -> None:
    """Stop `server` once stdin reaches end of file (its parent closed it, or died)."""
    sys.stdin.read()
    server.stop()


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parse_json(flag: str, text: str, schema: type[_Settings]) -> _Settings:
    """The `flag`'s JSON value as `schema`, or a one-line `UsageError` naming the flag."""
    try:
        return schema.model_validate(json.loads(text))
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} is not JSON ({e.msg} at char {e.pos})") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise UsageError(f"{flag}: {problems}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """`unified tinker-serve`: serve a model over the Tinker protocol until interrupted."""
    parser = argparse.ArgumentParser(
        prog="unified tinker-serve", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface (default: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--model",
        default="builtin:tiny",
        help="builtin:<size>, a local model dir or a model provider (package.module:function)",
    )
    parser.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another base-model name clients may use (repeatable), e.g. a hub id",
    )
    parser.add_argument("--api-key", default=None, help="require this X-API-Key (tml-...)")
    parser.add_argument("--store", type=Path, default=DEFAULT_STORE, help="tinker:// paths")
    parser.add_argument(
        "--max-batch",
        type=_at_least_one,
        default=64,
        help="most requests per batch (built-in engine; vLLM: max_num_seqs in --vllm)",
    )
    parser.add_argument(
        "--keep-samplers",
        type=_at_least_one,
        default=8,
        help="weight snapshots kept per training model",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="builtin",
        help="what samples: the built-in sampler or vLLM (needs the vllm package)",
    )
    parser.add_argument(
        "--vllm",
        default=None,
        metavar="JSON",
        help='the vLLM engine\'s settings (as local.vllm), e.g. {"kv_cache_gb": 0.5}',
    )
    parser.add_argument("--faults", default=None, help='JSON, e.g. {"http_500_rate": 0.1}')
    parser.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="stop when stdin closes (a parent process that dies takes the server with it)",
    )
    args = parser.parse_args(argv)
    # vLLM logs to stdout by default; stdout is where the URL line goes (`ServerProcess` reads
    # it first, and nobody reads the pipe after it).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

    def serve() -> int:
        faults = _parse_json("--faults", args.faults, Faults) if args.faults else None
        if args.vllm is not None and args.engine != "vllm":
            raise UsageError("--vllm sets the vLLM engine: add --engine vllm")
        vllm = _parse_json("--vllm", args.vllm, VllmSettings) if args.vllm else None
        server = LocalServer(
            resolve_model_spec(args.model),
            host=args.host,
            port=args.port,
            store=args.store,
            api_key=args.api_key,
            faults=faults,
            max_batch=args.max_batch,
            keep_samplers=args.keep_samplers,
            engine=args.engine,
            vllm=vllm,
            aliases=[args.model, *args.alias],  # a provider's name, not only its directory
        )
        url = server.start(timeout_s=START_TIMEOUT_S[args.engine])
        if args.exit_with_stdin:
            threading.Thread(target=_stop_at_eof, args=(server,), daemon=True).start()
        auth = "X-API-Key required" if args.api_key else "any tml- key"
        try:
            print(f"tinker-serve: {args.model} at {url} ({auth}; store {args.store})", flush=True)
            # The name clients that load a tokenizer from the model name (tinker-cookbook's
            # `model_name`) can use offline; the URL line stays first (ServerProcess reads it).
            print(
                f"tinker-serve: model_name for clients: {server.service.tokenizer_id}", flush=True
            )
        except BrokenPipeError:
            server.stop()  # whoever started it is gone before the model finished loading
            return 1
        try:
            server.wait()
        finally:
            server.stop()
        return 0

    return run_command(serve, prog="unified tinker-serve")


if __name__ == "__main__":
    sys.exit(main())

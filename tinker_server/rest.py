"""The REST side of the local Tinker server: what the SDK's `RestClient` calls.

Training runs (get, list), checkpoints (list per run and per user, delete, TTL, publish),
`weights_info`, and the download of exported weights: `external_weights_urls` answers one URL
per file of an `external_weights` checkpoint, signed with a per-server secret and valid for an
hour, so a plain HTTP GET (no API key) fetches it, as the service's signed URLs. Calls that make
no sense on a one-user local server are refused with HTTP 400 and one line saying why (400, not
501: the SDK retries 5xx for minutes).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from tinker_server.catalog import NotFound, page
from tinker_server.service import LocalTinker
from tinker_server.training import UserError

__all__ = ["FILES_PREFIX", "REFUSED", "add_rest_routes"]

FILES_PREFIX = "/api/v1/external_files/"
"""Downloads of exported weights: the signed URL is the credential (no API key)."""

URL_TTL_S = 3600

REFUSED: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/copy_weights"): "projects are not served here (one store, one user)",
    ("POST", "/api/v1/create_custom_loss"): "server-side custom losses are not served here; "
    "forward_backward_custom works (it runs the loss on the client)",
    ("GET", "/api/v1/sessions"): "session listing is not served here",
    ("POST", "/api/v1/sessions/search"): "session search is not served here",
    ("GET", "/api/v1/sessions/{session_id}"): "session lookup is not served here",
    ("PUT", "/api/v1/sessions/{session_id}/project"): "projects are not served here",
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): "trace export is not served here",
    ("GET", "/api/v1/auth/apikey/me"): "the local server has no accounts (any tml- key works)",
    ("POST", "/api/v1/auth/token"): "the local server has no accounts (any tml- key works)",
    ("GET", "/api/v1/audit"): "the local server keeps no audit log",
    ("GET", "/api/v1/billing/usage/events"): "the local server bills nothing",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "the local server bills nothing",
}
"""SDK calls refused on purpose, and the one line why."""


def add_rest_routes(app: FastAPI, service: LocalTinker) -> None:
    """Serve the REST endpoints of `service`'s store on `app`."""
    catalog = service.catalog
    secret = secrets.token_bytes(32)

    def sign(relative: str, expires: int) -> str:
        return hmac.new(secret, f"{relative}@{expires}".encode(), hashlib.sha256).hexdigest()

    @app.exception_handler(UserError)
    async def refused(request: Request, error: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 404 if isinstance(error, NotFound) else 400)

    @app.get("/api/v1/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        runs, cursor = page(catalog.runs(), limit, offset)
        return {"training_runs": runs, "cursor": cursor}

    @app.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str) -> dict[str, Any]:
        return catalog.run(run_id)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_checkpoints(run_id: str) -> dict[str, Any]:
        return {"checkpoints": catalog.checkpoints(run_id)}

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        checkpoints, cursor = page(catalog.checkpoints(), limit, offset)
        return {"checkpoints": checkpoints, "cursor": cursor}

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str) -> Response:
        catalog.delete(run_id, f"{kind}/{name}")
        return Response(status_code=204)

    @app.post("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish(run_id: str, kind: str, name: str) -> Response:
        catalog.update(run_id, f"{kind}/{name}", public=True)
        return Response(status_code=204)

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(run_id: str, kind: str, name: str) -> Response:
        catalog.update(run_id, f"{kind}/{name}", public=False)
        return Response(status_code=204)

    @app.put("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request) -> Response:
        payload = await request.json()
        ttl = payload.get("ttl_seconds") if isinstance(payload, dict) else None
        catalog.update(run_id, f"{kind}/{name}", ttl_seconds=ttl)
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        payload = await request.json()
        return service.weights_info(str(payload.get("tinker_path")))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(
        run_id: str, kind: str, name: str, request: Request
    ) -> dict[str, Any]:
        if kind != "external_weights":
            raise UserError("download URLs are for external_weights checkpoints only")
        directory = catalog.checkpoint_dir(run_id, f"{kind}/{name}")
        expires = int(catalog.clock()) + URL_TTL_S
        base = str(request.base_url).rstrip("/")
        urls = {}
        for file in sorted(f for f in directory.rglob("*") if f.is_file()):
            relative = file.relative_to(directory).as_posix()
            if relative == "checkpoint.json":
                continue
            where = f"{run_id}/{name}/{relative}"
            urls[relative] = (
                f"{base}{FILES_PREFIX}{where}?expires={expires}&sig={sign(where, expires)}"
            )
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    @app.get(FILES_PREFIX + "{run_id}/{name}/{relative:path}")
    async def external_file(
        run_id: str, name: str, relative: str, expires: int = 0, sig: str = ""
    ) -> Response:
        where = f"{run_id}/{name}/{relative}"
        if not hmac.compare_digest(sig, sign(where, expires)) or expires < catalog.clock():
            return JSONResponse({"detail": "the download URL is invalid or expired"}, 403)
        directory = catalog.checkpoint_dir(run_id, f"external_weights/{name}")
        file = (directory / relative).resolve()
        if not file.is_relative_to(directory.resolve()) or not file.is_file():
            raise NotFound(f"no file {relative!r} in {run_id}/external_weights/{name}")
        return FileResponse(Path(file))

    for (method, path), reason in REFUSED.items():
        app.add_api_route(path, _refusal(method, path, reason), methods=[method])


def _refusal(method: str, path: str, reason: str) -> Any:
    async def refuse() -> JSONResponse:
        return JSONResponse({"detail": f"{method} {path}: {reason}"}, 400)

    refuse.__name__ = f"refuse_{method}_{path}".replace("/", "_").replace("{", "").replace("}", "")
    return refuse

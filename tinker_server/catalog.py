"""Training runs and checkpoints of the local store, as the SDK's `RestClient` sees them.

A training run is a training model's id (`<session>:train:<n>`); `store/<run>/run.json` records
its base model, LoRA rank and `user_metadata` when it is made (or restored from saved state).
A checkpoint is a directory `store/<run>/<kind>/<name>/` (`weights`, `sampler_weights`,
`external_weights`) with `checkpoint.json`: when it was made, its `user_metadata`, its expiry
(`ttl_seconds`) and whether it is published. Expired checkpoints are deleted the next time the
store is read (every listing and every `tinker://` lookup sweeps first), so rolling checkpoints
with a TTL do not pile up. Answers are the SDK's shapes (`TrainingRun`, `Checkpoint`, `Cursor`).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker_server.training import UserError

__all__ = ["CHECKPOINT_TYPE", "Catalog", "NotFound", "page"]

CHECKPOINT_TYPE = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
"""The store's directory for each kind of checkpoint -> the SDK's `checkpoint_type`."""

OWNER = "local"
"""Every run's `model_owner`: the local server has one user."""


class NotFound(UserError):
    """No such training run or checkpoint (HTTP 404)."""


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UserError("user_metadata must be an object of strings")
    return {str(k): str(v) for k, v in value.items()}


class Catalog:
    """Runs and checkpoints under `store`; `clock` gives the time (tests move it)."""

    def __init__(self, store: Path, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self.last_request: dict[str, float] = {}

    # -- recording ----------------------------------------------------------------------------

    def record_run(
        self, run_id: str, *, base_model: str, lora_rank: int, user_metadata: Any
    ) -> None:
        """Note a new training run (a created or restored training model)."""
        directory = self.store / run_id
        directory.mkdir(parents=True, exist_ok=True)
        record = {
            "base_model": base_model,
            "lora_rank": lora_rank,
            "user_metadata": _metadata(user_metadata),
            "created": self.clock(),
        }
        (directory / "run.json").write_text(json.dumps(record))
        self.touch(run_id)

    def touch(self, run_id: str) -> None:
        """A request reached the run now (its `last_request_time`)."""
        self.last_request[run_id] = self.clock()

    def record_checkpoint(
        self, directory: Path, *, ttl_seconds: Any = None, user_metadata: Any = None
    ) -> None:
        """Note a saved checkpoint's time, expiry and metadata (`directory` already written)."""
        now = self.clock()
        ttl = None if ttl_seconds is None else int(ttl_seconds)
        if ttl is not None and ttl <= 0:
            raise UserError(f"ttl_seconds must be positive, got {ttl}")
        record = {
            "created": now,
            "expires_at": None if ttl is None else now + ttl,
            "user_metadata": _metadata(user_metadata),
            "public": False,
        }
        (directory / "checkpoint.json").write_text(json.dumps(record))

    # -- expiry -------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Delete every checkpoint whose TTL has run out."""
        now = self.clock()
        for directory in self._checkpoint_dirs():
            record = self._record(directory)
            if record.get("expires_at") is not None and record["expires_at"] <= now:
                shutil.rmtree(directory, ignore_errors=True)

    # -- reading ------------------------------------------------------------------------------

    def _checkpoint_dirs(self, run_id: str | None = None) -> Iterator[Path]:
        runs = [self.store / run_id] if run_id is not None else self._run_dirs()
        for run in runs:
            for kind in CHECKPOINT_TYPE:
                folder = run / kind
                if folder.is_dir():
                    yield from (d for d in folder.iterdir() if (d / "checkpoint.json").is_file())

    def _run_dirs(self) -> list[Path]:
        if not self.store.is_dir():
            return []
        return [d for d in self.store.iterdir() if (d / "run.json").is_file()]

    @staticmethod
    def _record(directory: Path) -> dict[str, Any]:
        record: dict[str, Any] = json.loads((directory / "checkpoint.json").read_text())
        return record

    def checkpoint_dir(self, run_id: str, checkpoint_id: str) -> Path:
        """The directory of `<kind>/<name>` in a run; NotFound if absent or expired."""
        self.sweep()
        kind, _, name = checkpoint_id.partition("/")
        if kind not in CHECKPOINT_TYPE or not name or "/" in name or name.startswith("."):
            raise UserError(f"checkpoint id {checkpoint_id!r} is not <kind>/<name>")
        directory = self.store / run_id / kind / name
        if not (directory / "checkpoint.json").is_file():
            raise NotFound(f"no checkpoint {checkpoint_id!r} in training run {run_id!r}")
        return directory

    def checkpoint(self, directory: Path) -> dict[str, Any]:
        """A checkpoint as the SDK's `Checkpoint`."""
        record = self._record(directory)
        run, kind, name = directory.parts[-3:]
        expires = record.get("expires_at")
        return {
            "checkpoint_id": f"{kind}/{name}",
            "checkpoint_type": CHECKPOINT_TYPE[kind],
            "time": _iso(record["created"]),
            "tinker_path": f"tinker://{run}/{kind}/{name}",
            "size_bytes": sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()),
            "public": bool(record.get("public")),
            "user_metadata": record.get("user_metadata"),
            "expires_at": None if expires is None else _iso(expires),
        }

    def checkpoints(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """A run's checkpoints (all runs' if None), newest first."""
        self.sweep()
        if run_id is not None:
            self.run(run_id)
        found = [(self._record(d)["created"], d) for d in self._checkpoint_dirs(run_id)]
        return [self.checkpoint(d) for _, d in sorted(found, key=lambda x: x[0], reverse=True)]

    def run(self, run_id: str) -> dict[str, Any]:
        """A training run as the SDK's `TrainingRun`."""
        path = self.store / run_id / "run.json"
        if "/" in run_id or not path.is_file():
            raise NotFound(f"no training run {run_id!r} on this server")
        self.sweep()
        record = json.loads(path.read_text())
        checkpoints = [self.checkpoint(d) for d in self._checkpoint_dirs(run_id)]
        checkpoints.sort(key=lambda c: c["time"])

        def last(kind: str) -> dict[str, Any] | None:
            of_kind = [c for c in checkpoints if c["checkpoint_type"] == kind]
            return of_kind[-1] if of_kind else None

        return {
            "training_run_id": run_id,
            "base_model": record["base_model"],
            "model_owner": OWNER,
            "is_lora": True,
            "lora_rank": record["lora_rank"],
            "last_request_time": _iso(self.last_request.get(run_id, record["created"])),
            "last_checkpoint": last("training"),
            "last_sampler_checkpoint": last("sampler"),
            "user_metadata": record.get("user_metadata"),
        }

    def runs(self) -> list[dict[str, Any]]:
        """Every training run in the store, most recently used first."""
        found = [self.run(d.name) for d in self._run_dirs()]
        return sorted(found, key=lambda r: r["last_request_time"], reverse=True)

    # -- changing -----------------------------------------------------------------------------

    def delete(self, run_id: str, checkpoint_id: str) -> None:
        """Delete one checkpoint (the cookbook's rolling checkpoints)."""
        shutil.rmtree(self.checkpoint_dir(run_id, checkpoint_id))

    def update(self, run_id: str, checkpoint_id: str, **changes: Any) -> None:
        """Set `public` or `ttl_seconds` (None: never expires) of a checkpoint."""
        directory = self.checkpoint_dir(run_id, checkpoint_id)
        record = self._record(directory)
        if "public" in changes:
            record["public"] = bool(changes["public"])
        if "ttl_seconds" in changes:
            ttl = changes["ttl_seconds"]
            if ttl is not None and int(ttl) <= 0:
                raise UserError(f"ttl_seconds must be positive, got {ttl}")
            record["expires_at"] = None if ttl is None else self.clock() + int(ttl)
        (directory / "checkpoint.json").write_text(json.dumps(record))


def page(items: list[dict[str, Any]], limit: int, offset: int) -> tuple[list[Any], dict[str, int]]:
    """One page of `items` and the SDK's `Cursor` for it."""
    if limit < 0 or offset < 0:
        raise UserError(f"limit and offset must not be negative (got {limit}, {offset})")
    cursor = {"offset": offset, "limit": limit, "total_count": len(items)}
    return items[offset : offset + limit], cursor

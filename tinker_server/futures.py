"""Futures of the local Tinker server: every submitted request resolves exactly once.

A request (`forward_backward`, `asample`, ...) is answered at once with a request id; its work
runs as a task in the server's task group and ends as a result (JSON or protobuf bytes) or an
error future (`{"error", "category"}`), never as a dropped connection: an exception inside the
work is caught and becomes an error future, because the SDK retries a broken connection forever.
`retrieve` long-polls: it answers when the result is ready or after `poll_s` with `try_again`
(HTTP 408, as the service does: the SDK polls again at once; a `try_again` with HTTP 200 made it
log a warning per poll, a flood under load).
Results stay retrievable for `keep_s` after they complete (the SDK may poll again after giving
up on a slow poll), then they are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["ErrorCategory", "FutureStore", "Outcome"]

ErrorCategory = Literal["user", "server", "unknown"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How a request ended: a body and its media type, or an error and its category."""

    body: bytes = b""
    media_type: str = "application/json"
    error: str | None = None
    category: ErrorCategory = "server"


@dataclass
class _Entry:
    done: asyncio.Event
    outcome: Outcome | None = None
    completed_at: float = 0.0


class FutureStore:
    """Request ids -> outcomes; the work of each runs in the task group given to `open`."""

    def __init__(self, *, poll_s: float = 20.0, keep_s: float = 300.0) -> None:
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._entries: dict[str, _Entry] = {}
        self._completed: deque[str] = deque()
        self._ids = itertools.count(1)
        self._tasks: asyncio.TaskGroup | None = None
        self._running: set[asyncio.Task[None]] = set()

    def open(self, tasks: asyncio.TaskGroup) -> None:
        """Run future work in `tasks` (the server's lifespan task group)."""
        self._tasks = tasks

    def submit(self, kind: str, work: Callable[[], Awaitable[Outcome]]) -> str:
        """Start `work` and return the id its outcome will be retrievable under."""
        if self._tasks is None:
            raise RuntimeError("FutureStore.open was not called (server not started)")
        request_id = f"{kind}-{next(self._ids)}"
        entry = _Entry(done=asyncio.Event())
        self._entries[request_id] = entry
        task = self._tasks.create_task(self._run(request_id, entry, work))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        self._evict()
        return request_id

    def cancel_all(self) -> None:
        """Cancel the work still running (at shutdown); its futures resolve as errors."""
        for task in list(self._running):
            task.cancel()

    async def _run(
        self, request_id: str, entry: _Entry, work: Callable[[], Awaitable[Outcome]]
    ) -> None:
        try:
            outcome = await work()
        except asyncio.CancelledError:
            outcome = Outcome(error="the server is shutting down", category="server")
            raise
        except Exception as e:
            # An answer, never a dropped connection: the SDK would retry that forever.
            log.exception("request %s failed", request_id)
            outcome = Outcome(error=f"{type(e).__name__}: {e}", category="server")
        finally:
            entry.outcome = outcome
            entry.completed_at = time.monotonic()
            self._completed.append(request_id)
            entry.done.set()

    async def retrieve(self, request_id: str) -> Outcome | None:
        """The outcome of `request_id`, or None if it is not ready within `poll_s`.

        Raises KeyError for an id the server never issued or has dropped.
        """
        entry = self._entries[request_id]
        try:
            async with asyncio.timeout(self.poll_s):
                await entry.done.wait()
        except TimeoutError:
            return None
        return entry.outcome

    def _evict(self) -> None:
        cutoff = time.monotonic() - self.keep_s
        while self._completed and self._entries[self._completed[0]].completed_at < cutoff:
            self._entries.pop(self._completed.popleft(), None)

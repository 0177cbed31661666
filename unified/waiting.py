"""Changes: how the trainer's tasks wait on shared state without polling, and never forever.

The owner of some state calls `changed()` after every change and `progressed()` when work moved
on without changing it (an episode finished, its group not yet); a waiter calls
`wait_until(predicate, what)`, which re-checks the predicate once per change and fails with a
`StallError` after `stall_timeout_s` without progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from unified.errors import StallError

__all__ = ["Changes"]


class Changes:
    """Change notification with a stall clock; `describe` says who is where in its errors."""

    def __init__(self, stall_timeout_s: float, describe: Callable[[], str]) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._describe = describe
        self._changed = asyncio.Event()
        self._progress_at = time.monotonic()

    def progressed(self) -> None:
        """Work moved on: restart the stall clock (no waiter is woken)."""
        self._progress_at = time.monotonic()

    def changed(self) -> None:
        """The state changed: every waiter re-checks its predicate, once."""
        # Replace the event so each waiter re-checks its predicate exactly once per change.
        self._progress_at = time.monotonic()
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(
        self, predicate: Callable[[], bool], what: str, *, stall_clock: bool = True
    ) -> None:
        """Wait until `predicate()` holds; fail if nothing progresses for `stall_timeout_s`.

        Every change and every progress restarts the clock. `stall_clock=False` waits without
        it, for waits that only the trainer itself can end (admission, while it evaluates or
        saves).
        """
        limit = self.stall_timeout_s
        since = time.monotonic()
        while not predicate():
            changed = self._changed
            if not stall_clock:
                await changed.wait()
                continue
            while not changed.is_set():
                quiet_until = max(since, self._progress_at) + limit
                try:
                    async with asyncio.timeout(quiet_until - time.monotonic()):
                        await changed.wait()
                except TimeoutError:
                    if self._progress_at + limit <= time.monotonic():
                        raise StallError(
                            f"waited {limit:g} s for {what} with no progress "
                            f"({self._describe()}); raise trainer.stall_timeout_s if steps are "
                            "legitimately this slow"
                        ) from None

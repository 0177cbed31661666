"""GracefulStop: what a stop request (SIGINT/SIGTERM in `fit`) changes in the training loop.

Dispatch stops at once. The step in progress (between steps: the next one, whose groups may all
be out already) is the last: it trains if its groups are ready within `trainer.stop_grace_s`,
else it is abandoned without an optimizer step (`StepAbandoned`), and a checkpoint then holds
every group not trained, to dispatch again.
"""

from __future__ import annotations

import asyncio
import math

from unified.groups import GroupTicket, TrajectoryGroupBuffer
from unified.types import TrajectoryGroup

__all__ = ["GracefulStop", "StepAbandoned"]


class StepAbandoned(Exception):
    """A stop was requested and the step in progress cannot get its groups within the grace."""


class GracefulStop:
    """The stop state of one `fit`: which signal, the last step, and when the grace ends."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signal: int | None = None
        """The signal number the stop was requested with, once it was."""
        self.last_step: float = math.inf
        self._deadline: float | None = None  # event-loop time the grace ends
        self._ready_wait: asyncio.Timeout | None = None

    def request(self, signal_number: int, step: int) -> bool:
        """Stop after the step following `step`; False if a stop was already requested.

        Call it on the event loop that trains (a signal handler added with
        `loop.add_signal_handler` runs there)."""
        if self.signal is not None:
            return False
        self.signal = signal_number
        # Its groups may all be dispatched (even ready) already, if the stop came between steps.
        self.last_step = step + 1
        self._deadline = asyncio.get_running_loop().time() + self.grace_s
        if self._ready_wait is not None:
            self._ready_wait.reschedule(self._deadline)
        return True

    async def next_ready(
        self, groups: TrajectoryGroupBuffer, needed: int
    ) -> tuple[GroupTicket, TrajectoryGroup]:
        """The next group to train; after a stop, only within the grace and if `needed` more
        groups are still alive (no new ones are dispatched)."""
        if self.signal is not None and groups.alive < needed:
            raise StepAbandoned
        wait = self._ready_wait = asyncio.timeout_at(self._deadline)
        try:
            async with wait:
                return await groups.next_ready()
        except TimeoutError:
            if wait.expired():
                raise StepAbandoned from None
            raise
        finally:
            self._ready_wait = None

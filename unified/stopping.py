"""GracefulStop: what a stop request (SIGINT/SIGTERM in `fit`) changes in the training loop.

Dispatch stops at once. The step in progress (between steps: the next one, whose groups may all
be out already) is the last: it trains if its groups are ready within `trainer.stop_grace_s`,
else it is abandoned without an optimizer step (`StepAbandoned`), and a checkpoint then holds
every group not trained, to dispatch again. `no_signal_message` says why a run stops by itself
when no group gives a learning signal any more.
"""

from __future__ import annotations

import asyncio
import math

from unified.groups import GroupTicket, TrajectoryGroupBuffer
from unified.types import TrajectoryGroup

__all__ = ["GracefulStop", "StepAbandoned", "no_signal_message"]


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


def no_signal_message(groups: TrajectoryGroupBuffer, step: int, entropy: float | None) -> str:
    """Why the run stops when `trainer.max_filtered_in_a_row` groups of `groups` ended filtered
    or failed in a row after `step` trained steps (`entropy`: the last step's), and what to
    change (`TrainingStopped`)."""
    what = (
        f"the last {groups.unproductive_in_a_row} groups all ended filtered (equal rewards) "
        f"or failed (last one {groups.last_unproductive_reason})"
    )
    if 2 * groups.failed_in_a_row > groups.unproductive_in_a_row:
        return (
            f"{what}, most of them failed, after {step} trained steps: the workflow errs or "
            "times out (episodes/errors, episodes/timeouts and the log say which); fix it, or "
            "raise trainer.workflow_timeout_s if episodes legitimately take longer"
        )
    if step == 0:
        return (
            f"{what} before any step trained: the rewards give no learning signal for this "
            "policy; check the workflow's reward and that the model can solve some tasks"
        )
    seen = f" (train/entropy {entropy:.3g} at the last step)" if entropy is not None else ""
    return (
        f"{what} after {step} trained steps: the policy has collapsed onto answers that "
        f"score the same within a group{seen}; resume from an earlier checkpoint with a "
        "lower trainer.lr, or a larger trainer.entropy_coef or trainer.kl_coef"
    )

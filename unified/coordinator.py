"""SyncCoordinator: the policy version, admission control, pause/resume and in-flight counts.

Staleness is a hard per-group guarantee, not a count. A group dispatched at version `p` must be
trained while the weights are at most version `p + max_staleness` (its deadline). Each version
trains `sync_every * batch_size` groups (its slots). The coordinator admits a new group only while
every deadline stays feasible, which works out to `alive + taken_since_sync < (1 + s) * K * M`
(alive: dispatched, not yet trained or ended); the consumer takes a ready group only while the
groups with earlier deadlines still fit in the slots left (`may_take`). Groups that end filtered
or failed `resolve` and free their slot at once, so nothing waits on a group that will never come.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from asyncio_throttle.throttler import Throttler

from unified.errors import StallError

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = ["SyncCoordinator"]


class SyncCoordinator:
    """Owns the policy version and decides when a group may be dispatched or trained.

    All methods run on the event loop; none blocks. Waits have a deadline of `stall_timeout`
    seconds *without progress*: every state change restarts the clock.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        sync_every: int,
        max_staleness: int,
        max_concurrency: int,
        dispatch_rate: float | None = None,
        stall_timeout: float = 600.0,
    ) -> None:
        self.version = 0
        self.max_staleness = max_staleness
        self.slots_per_version = sync_every * batch_size
        self.capacity = (1 + max_staleness) * self.slots_per_version
        self._stall_timeout = stall_timeout
        self._alive: Counter[int] = Counter()
        self._taken = 0
        self._wanted: int | None = None
        self._paused = False
        self._generating = 0
        self._running = 0
        self._changed = asyncio.Event()
        self._workflow_slots = asyncio.Semaphore(max_concurrency)
        self._throttler: Throttler | None = None
        if dispatch_rate is not None:
            # Evenly spaced starts, no bursts: what remote APIs' rate limits expect.
            self._throttler = Throttler(rate_limit=1, period=1.0 / dispatch_rate)
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0

    @classmethod
    def for_config(cls, config: TrainerConfig) -> SyncCoordinator:
        """The coordinator of a run: batch, sync window, staleness and limits from `config`."""
        t, a = config.trainer, config.async_
        return cls(
            batch_size=t.batch_size,
            sync_every=a.sync_every,
            max_staleness=a.max_staleness,
            max_concurrency=a.max_concurrency,
            dispatch_rate=a.dispatch_rate,
            stall_timeout=t.stall_timeout,
        )

    # -- admission ---------------------------------------------------------------------------

    @property
    def alive(self) -> int:
        """Groups dispatched and not yet taken for training, filtered or failed."""
        return sum(self._alive.values())

    @property
    def running(self) -> int:
        """Workflow runs executing now."""
        return self._running

    def can_dispatch(self) -> bool:
        """Whether a new group may be dispatched now (staleness, run length and pause allow it)."""
        if self._paused or self.alive + self._taken >= self.capacity:
            return False
        return self._wanted is None or self.alive < self._wanted

    async def admit(self) -> int:
        """Wait until a group may be dispatched; register it and return its version stamp.

        No stall clock here: slots are freed by the consumer (training, evaluating, saving), and
        each of the consumer's own waits has its deadline.
        """
        await self.wait_until(self.can_dispatch, "an admission slot", stall_clock=False)
        self._alive[self.version] += 1
        self._generating += 1
        self._mark_busy()
        return self.version

    def set_wanted(self, groups: int | None) -> None:
        """Cap alive groups at what the run still needs to train (None: no cap)."""
        self._wanted = groups
        self._notify()

    def generated(self) -> None:
        """All workflows of one dispatched group have finished."""
        self._generating -= 1
        if self._generating == 0:
            self._idle_since = time.monotonic()
        self._notify()

    def resolve(self, version: int) -> None:
        """A dispatched group ended without training (filtered or failed): free its slot."""
        self._release(version)
        self._notify()

    def may_take(self, version: int) -> bool:
        """Whether a ready group of `version` may be trained now without starving earlier ones."""
        s, slots = self.max_staleness, self.slots_per_version
        if version + s < self.version:
            raise AssertionError(
                f"group of version {version} is {self.version - version} versions stale "
                f"(max_staleness={s}): admission failed to keep its deadline"
            )
        slots_left = slots - self._taken
        if slots_left <= 0:
            return False
        for deadline in range(self.version, version + s):
            due = sum(c for v, c in self._alive.items() if v + s <= deadline)
            if due >= slots_left + (deadline - self.version) * slots:
                return False
        return True

    def take(self, version: int) -> None:
        """A ready group of `version` goes into the current optimizer step."""
        self._release(version)
        self._taken += 1
        self._notify()

    # -- weight sync -------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop admitting new groups (running ones continue)."""
        self._paused = True
        self._notify()

    def resume(self) -> None:
        """Admit groups again."""
        self._paused = False
        self._notify()

    async def drain(self) -> None:
        """Wait until no dispatched group is still generating."""
        await self.wait_until(lambda: self._generating == 0, "in-flight groups to finish")

    def restore(self, version: int, *, taken_since_sync: int) -> None:
        """Resume: weights of `version` are visible and this many groups were trained since."""
        self.version = version
        self._taken = taken_since_sync
        self._notify()

    def synced(self, version: int) -> None:
        """Weights of `version` are now visible to sampling; a new window of slots opens."""
        self.version = version
        self._taken = 0
        self._notify()

    # -- workflows ---------------------------------------------------------------------------

    @asynccontextmanager
    async def workflow_slot(self) -> AsyncIterator[None]:
        """Hold one of `max_concurrency` workflow slots, after the dispatch-rate throttle."""
        async with self._workflow_slots:
            if self._throttler is not None:
                await self._throttler.acquire()  # type: ignore[no-untyped-call]
            self._running += 1
            try:
                yield
            finally:
                self._running -= 1

    def take_idle_seconds(self) -> float:
        """Seconds since the last call during which no group was generating."""
        idle = self._idle_s
        if self._idle_since is not None:
            now = time.monotonic()
            idle += now - self._idle_since
            self._idle_since = now
        self._idle_s = 0.0
        return idle

    # -- waiting -----------------------------------------------------------------------------

    async def wait_until(
        self, predicate: Callable[[], bool], what: str, *, stall_clock: bool = True
    ) -> None:
        """Wait until `predicate()` holds; fail if nothing changes for `stall_timeout` seconds.

        `stall_clock=False` waits without that clock, for waits that only others can end.
        """
        limit = self._stall_timeout if stall_clock else None
        while not predicate():
            changed = self._changed
            try:
                async with asyncio.timeout(limit):
                    await changed.wait()
            except TimeoutError:
                raise StallError(
                    f"waited {limit:g} s for {what} with no progress "
                    f"(alive={self.alive}, generating={self._generating}, version={self.version}); "
                    "raise trainer.stall_timeout if steps are legitimately this slow"
                ) from None

    def notify(self) -> None:
        """Wake waiters: something they may be waiting for changed."""
        self._notify()

    def stats(self) -> dict[str, float]:
        """Gauges for the metrics line."""
        return {
            "async/alive_groups": float(self.alive),
            "async/generating_groups": float(self._generating),
            "async/running_workflows": float(self._running),
        }

    def _release(self, version: int) -> None:
        if self._alive[version] <= 0:
            raise AssertionError(f"no alive group of version {version} to release")
        self._alive[version] -= 1
        if self._alive[version] == 0:
            del self._alive[version]

    def _mark_busy(self) -> None:
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None

    def _notify(self) -> None:
        # Replace the event so each waiter re-checks its predicate exactly once per change.
        self._changed.set()
        self._changed = asyncio.Event()

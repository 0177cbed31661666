"""SyncCoordinator: the policy version and the admission arithmetic that bounds staleness.

Staleness is a hard per-group guarantee, not a count. A group dispatched at version `p` must be
trained while the weights are at most version `p + max_staleness` (its deadline). Each window of
`sync_every` optimizer steps trains `sync_every * batch_size` groups (its slots). A group is
admitted only while every deadline stays feasible, which works out to
`alive + taken < (1 + max_staleness) * slots` (alive: admitted, not yet taken or ended); a ready
group is taken only while the groups with earlier deadlines still fit in the slots left
(`may_take`). A group that ends untrained is `release`d and frees its slot at once.

Pure arithmetic: no waiting, no clocks, no tasks. `TrajectoryGroupBuffer` is its one caller.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = ["SyncCoordinator"]


class SyncCoordinator:
    """Owns the policy version and decides when a group may be admitted or trained."""

    def __init__(self, *, batch_size: int, sync_every: int, max_staleness: int) -> None:
        self.version = 0
        self.max_staleness = max_staleness
        self.steps_per_window = sync_every
        self.slots_per_window = sync_every * batch_size
        self.capacity = (1 + max_staleness) * self.slots_per_window
        self.taken = 0
        self.wanted: int | None = None
        self._alive: Counter[int] = Counter()
        self._alive_total = 0

    @classmethod
    def for_config(cls, config: TrainerConfig) -> SyncCoordinator:
        """The coordinator of a run.

        Sync mode is the same arithmetic at staleness 0 with a window of one step (the loop
        opens a new window after every step), so a step's batch is generated after the last
        step trained.
        """
        trainer, async_ = config.trainer, config.async_
        if config.mode == "sync":
            return cls(batch_size=trainer.batch_size, sync_every=1, max_staleness=0)
        return cls(
            batch_size=trainer.batch_size,
            sync_every=async_.sync_every,
            max_staleness=async_.max_staleness,
        )

    @property
    def alive(self) -> int:
        """Groups admitted and not yet taken for training or ended."""
        return self._alive_total

    def can_admit(self) -> bool:
        """Whether one more group may be dispatched now (staleness and run length allow it)."""
        if self._alive_total + self.taken >= self.capacity:
            return False
        return self.wanted is None or self._alive_total < self.wanted

    def admit(self) -> int:
        """Register a dispatched group; return its version stamp. Call only if `can_admit()`."""
        self._alive[self.version] += 1
        self._alive_total += 1
        return self.version

    def release(self, version: int) -> None:
        """A group of `version` ended without training (filtered or failed): free its slot."""
        count = self._alive[version]
        if count <= 0:
            raise AssertionError(f"no alive group of version {version} to release")
        if count == 1:
            del self._alive[version]
        else:
            self._alive[version] = count - 1
        self._alive_total -= 1

    def may_take(self, version: int) -> bool:
        """Whether a ready group of `version` may be trained now without starving earlier ones."""
        s, slots = self.max_staleness, self.slots_per_window
        if version + s < self.version:
            raise AssertionError(
                f"group of version {version} is {self.version - version} versions stale "
                f"(max_staleness={s}): admission failed to keep its deadline"
            )
        slots_left = slots - self.taken
        if slots_left <= 0:
            return False
        for deadline in range(self.version, version + s):
            due = sum(c for v, c in self._alive.items() if v + s <= deadline)
            if due >= slots_left + (deadline - self.version) * slots:
                return False
        return True

    def take(self, version: int) -> None:
        """A ready group of `version` goes into the current optimizer step."""
        self.release(version)
        self.taken += 1

    def open_window(self, version: int) -> None:
        """Weights of `version` serve sampling from now on; a new window of slots opens."""
        self.version = version
        self.taken = 0

    def restore(self, version: int, *, taken: int) -> None:
        """Resume: weights of `version` are visible and `taken` groups trained in this window."""
        self.version = version
        self.taken = taken

"""SyncCoordinator: the policy version and the admission arithmetic that bounds staleness.

Two rules, one per `async.strict_staleness`:

- **Admission by count** (the default; AReaL's rule). Generation runs at most `max_staleness`
  windows ahead of training: a group is admitted only while the groups admitted and not yet
  trained fit in the next `1 + max_staleness` windows, `pending + taken < (1 + max_staleness) *
  slots` (pending: the groups generating or ready; taken: trained in this window). Counted
  whole, groups trained in admission order are never more than `max_staleness` versions behind.
  A group still generating counts only its running episodes (over `group_size`) once its
  deadline (`version + max_staleness`) has passed, a straggler, or while no group is ready (the
  trainer waits on generation, so nothing queued can age): its finished episodes, waiting on
  its slowest one, would otherwise keep the engine from new work. Nothing expires: every group
  trains, oldest first, however long its slowest episode took; what that costs in freshness is
  measured per token (`lag/token_*`), not bounded.
- **The hard per-group bound** (`strict_staleness: true`). A group dispatched at version `p`
  must be trained while the weights are at most version `p + max_staleness` (its deadline).
  Each window of `sync_every` optimizer steps trains `sync_every * batch_size` groups (its
  slots). A group is admitted only while every deadline stays feasible,
  `alive + taken < (1 + max_staleness) * slots` (alive: admitted, not yet taken or ended); a
  ready group is taken only while the groups with earlier deadlines still fit in the slots left
  (`may_take`). A group that ends untrained is `release`d and frees its slot at once.

  Over-admission (async mode, strict rule only): while generation has spare capacity, up to
  `extra` groups more than the deadlines can hold are admitted. That many groups will miss their
  deadline anyway, so `may_take` lets the trainer pass over as many unfinished groups with
  earlier deadlines, and the groups whose deadline has passed when a window opens are
  `expired`: the buffer gives their tasks back to the queue. `extra` adapts between 0 and
  `max_extra`: it doubles (from one) each time the trainer waits while a group is still
  generating and its window has room (`note_blocked`), and loses one after `1 + max_staleness`
  windows in a row that threw away groups that were ready while the trainer never waited
  (`note_wasted`): a wait costs the trainer's time, a wasted group only spare generation. With
  `max_extra=0` (always in sync mode) no group ever expires.

Both rules give the run's last groups an allowance (`wanted`), so the last step need not wait
on its slowest group. The coordinator also decides when the weights sync (`after_step`): every
`sync_every` optimizer steps, in both modes. Pure arithmetic: no waiting, no clocks, no tasks.
`TrajectoryGroupBuffer` is its one caller.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = ["SyncCoordinator"]


class SyncCoordinator:
    """Owns the policy version and decides when a group may be admitted or trained."""

    def __init__(
        self,
        *,
        batch_size: int,
        sync_every: int,
        max_staleness: int,
        strict: bool,
        max_extra: int = 0,
        steps_per_window: int | None = None,
    ) -> None:
        if max_extra and not strict:
            raise ValueError("over-admission (max_extra) belongs to the strict rule only")
        self.version = 0
        self.strict = strict
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.sync_every = sync_every
        self.steps_per_window = sync_every if steps_per_window is None else steps_per_window
        self.slots_per_window = self.steps_per_window * batch_size
        self.capacity = (1 + max_staleness) * self.slots_per_window
        self.max_extra = max_extra
        self.extra = 0
        # Counting admits as many groups beyond the run's last ones as one window trains: they
        # are the final checkpoint's work in flight, and the last step need not wait on its
        # slowest group.
        self.end_extra = 0 if strict else self.slots_per_window
        self._blocked = False  # the trainer waited on a generating group in this window
        self._calm_windows = 0  # windows in a row that wasted groups while the trainer never waited
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
            return cls(
                batch_size=trainer.batch_size,
                sync_every=async_.sync_every,
                max_staleness=0,
                strict=True,
                steps_per_window=1,
            )
        if not async_.strict_staleness:
            return cls(
                batch_size=trainer.batch_size,
                sync_every=async_.sync_every,
                max_staleness=async_.max_staleness,
                strict=False,
            )
        slots = async_.sync_every * trainer.batch_size
        return cls(
            batch_size=trainer.batch_size,
            sync_every=async_.sync_every,
            max_staleness=async_.max_staleness,
            strict=True,
            max_extra=math.ceil(async_.resolved_over_admit * slots),
        )

    @property
    def alive(self) -> int:
        """Groups admitted and not yet taken for training or ended."""
        return self._alive_total

    @property
    def surplus(self) -> int:
        """Groups admitted beyond what the deadlines can hold: that many will expire."""
        if not self.strict:
            return 0
        return max(0, self._alive_total + self.taken - self.capacity)

    def can_admit(self, *, spare: bool = False, pending: float = 0.0) -> bool:
        """Whether one more group may be dispatched now (staleness and run length allow it).

        Counting: `pending` is the work admitted and not yet taken, in groups (the buffer's
        `pending`). Strict: `spare` says generation has idle capacity, so up to `extra` more
        groups may go out."""
        if not self.strict:
            if pending + self.taken >= self.capacity:
                return False
            extra = self.end_extra
        else:
            # At staleness 0 a group admitted into a full window can never train: no extra then.
            full = self.max_staleness == 0 and self.taken >= self.slots_per_window
            extra = self.extra if spare and not full else 0
            if self._alive_total + self.taken >= self.capacity + extra:
                return False
        if self.wanted is None:
            return True
        # As many groups beyond the run's last ones as will expire anyway (none after a stop):
        # else the last step waits on the slowest of exactly the groups it trains.
        return self._alive_total < self.wanted + (extra if self.wanted else 0)

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
        if not self.strict:  # no deadlines: the oldest ready group, while the window has room
            return self.taken < slots
        if version + s < self.version:
            raise AssertionError(
                f"group of version {version} is {self.version - version} versions stale "
                f"(max_staleness={s}): admission failed to keep its deadline"
            )
        slots_left = slots - self.taken
        if slots_left <= 0:
            return False
        may_miss = self.surplus  # groups that will expire anyway: the trainer need not wait
        for deadline in range(self.version, version + s):
            due = sum(c for v, c in self._alive.items() if v + s <= deadline)
            if due - may_miss >= slots_left + (deadline - self.version) * slots:
                return False
        return True

    def take(self, version: int) -> None:
        """A ready group of `version` goes into the current optimizer step."""
        self.release(version)
        self.taken += 1

    def open_window(self, version: int) -> None:
        """Weights of `version` serve sampling from now on; a new window of slots opens.

        The buffer then requeues the groups whose deadline has passed."""
        self.version = version
        self.taken = 0

    def after_step(self, step: int) -> int | None:
        """Optimizer step `step` is done: the version the weights must sync to now, or None (a
        window that ends without a sync reopens at the same version here)."""
        if step % self.sync_every == 0:
            return self.version + 1
        if step % self.steps_per_window == 0:
            self.open_window(self.version)
        return None

    def note_blocked(self) -> None:
        """The trainer waits on groups still generating: once every group allowed beyond the
        bound went out, double the allowance (one at least), up to `max_extra`."""
        self._blocked = True
        if self.surplus >= self.extra and self.extra < self.max_extra:
            self.extra = min(self.max_extra, max(1, 2 * self.extra))

    def note_wasted(self, groups: int) -> None:
        """A window closed with `groups` expired ready, generated for nothing.

        After `1 + max_staleness` such windows in a row in which the trainer never waited, allow
        one group fewer: a change of the allowance shows only once the groups it admitted have
        trained or expired, that many windows later, and a wait costs the trainer more than a
        group costs spare generation."""
        calm = groups > 0 and not self._blocked
        self._calm_windows = self._calm_windows + 1 if calm else 0
        if self._calm_windows > self.max_staleness:
            self.extra = max(0, self.extra - 1)
            self._calm_windows = 0
        self._blocked = False

    def expired(self, version: int) -> bool:
        """Whether a group dispatched at `version` can no longer train within its deadline
        (never, when counting: every group trains)."""
        return self.strict and version + self.max_staleness < self.version

    def restore(self, version: int, *, taken: int) -> None:
        """Resume: weights of `version` are visible and `taken` groups trained in this window."""
        self.version = version
        self.taken = taken

"""TrajectoryGroupBuffer: episodes in, ready-to-train groups out; every group ends exactly once.

Episodes of a dispatched group arrive one by one, in any order. When the last one lands the group
ends in exactly one of three ways: *failed* (fewer than two usable episodes), *filtered* (all
rewards equal, so no learning signal), or *ready* (advantages computed, waiting to be trained).
Failed and filtered groups free their admission slot in the coordinator at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from unified.advantages import compute_advantages
from unified.coordinator import SyncCoordinator
from unified.metrics import MetricsAggregator
from unified.types import Episode, TrajectoryGroup

__all__ = ["EndedGroup", "GroupTicket", "Outcome", "TrajectoryGroupBuffer"]

Outcome = Literal["trained", "filtered", "failed"]


@dataclass(frozen=True, order=True)
class GroupTicket:
    """A dispatched group: ordered by (dispatch version, dispatch sequence number)."""

    version: int
    seq: int
    group_id: str = field(compare=False)
    task_id: str = field(compare=False)


@dataclass(frozen=True)
class EndedGroup:
    """A group that ended: what the ledger records about it."""

    ticket: GroupTicket
    outcome: Outcome
    policy_version: int
    reason: str = ""
    rewards: tuple[float, ...] = ()


class TrajectoryGroupBuffer:
    """Collects episodes into groups and holds ready groups until the trainer takes them."""

    def __init__(
        self,
        *,
        group_size: int,
        advantage: str,
        filter_groups: bool,
        coordinator: SyncCoordinator,
        metrics: MetricsAggregator,
    ) -> None:
        self.group_size = group_size
        self.advantage = advantage
        self.filter_groups = filter_groups
        self._coordinator = coordinator
        self._metrics = metrics
        self._pending: dict[str, tuple[GroupTicket, list[Episode]]] = {}
        self._ready: dict[GroupTicket, TrajectoryGroup] = {}
        self._ended: list[EndedGroup] = []
        self.unproductive_in_a_row = 0
        self.last_unproductive_reason = ""

    def open(self, ticket: GroupTicket) -> None:
        """Register a dispatched group before its episodes start."""
        self._pending[ticket.group_id] = (ticket, [])

    def add_episode(self, group_id: str, episode: Episode) -> None:
        """Add one finished episode; the group ends when its `group_size`-th episode arrives."""
        ticket, episodes = self._pending[group_id]
        episodes.append(episode)
        if len(episodes) == self.group_size:
            del self._pending[group_id]
            self._coordinator.generated()
            self._end(ticket, sorted(episodes, key=lambda e: e.rollout_index))

    def abandon(self, group_id: str) -> None:
        """Forget a group whose episodes were cancelled (the run is ending)."""
        self._pending.pop(group_id, None)

    def pop_ready(
        self, may_take: Callable[[int], bool]
    ) -> tuple[GroupTicket, TrajectoryGroup] | None:
        """Remove and return the oldest ready group that `may_take(version)` allows, if any."""
        for ticket in sorted(self._ready):
            if may_take(ticket.version):
                return ticket, self._ready.pop(ticket)
        return None

    def pop_ended(self) -> list[EndedGroup]:
        """Groups that ended filtered or failed since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def _end(self, ticket: GroupTicket, episodes: list[Episode]) -> None:
        usable = [e for e in episodes if e.status == "ok"]
        oldest = min([ticket.version, *(e.oldest_version for e in usable)])
        rewards = [e.reward for e in usable]
        if len(usable) < min(2, self.group_size):
            reason = f"{len(episodes) - len(usable)} of {len(episodes)} episodes failed"
            self._resolve(EndedGroup(ticket, "failed", oldest, reason, tuple(rewards)))
            return
        if self.filter_groups and len(usable) > 1 and max(rewards) == min(rewards):
            reason = f"all rewards {rewards[0]:g}"
            self._resolve(EndedGroup(ticket, "filtered", oldest, reason, tuple(rewards)))
            return
        self.unproductive_in_a_row = 0
        self._ready[ticket] = TrajectoryGroup(
            task_id=ticket.task_id,
            episodes=usable,
            advantages=compute_advantages(self.advantage, rewards),
            policy_version=oldest,
            group_id=ticket.group_id,
        )
        self._coordinator.notify()

    def _resolve(self, ended: EndedGroup) -> None:
        self.unproductive_in_a_row += 1
        self.last_unproductive_reason = f"{ended.outcome}: {ended.reason}"
        self._metrics.record(f"groups/{ended.outcome}", 1.0)
        self._ended.append(ended)
        self._coordinator.resolve(ended.ticket.version)

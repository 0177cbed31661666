"""TrajectoryGroupBuffer: the one owner of every dispatched group, from admission to its outcome.

A group is dispatched (admitted by the coordinator's arithmetic, given a task and a ticket),
collects its `group_size` episodes in any order, then ends exactly once: *failed* (fewer than two
usable episodes), *filtered* (all rewards equal: no learning signal) or *ready* (advantages
computed), and a ready group later ends *trained*. Under the strict staleness rule a group
whose deadline passes before it trains ends *requeued*: its running episodes are cancelled and
its task goes back to the queue under a new sequence number; by default nothing is requeued
before the run's end. The buffer frees the admission slot of every
group that ends untrained, writes every group's ledger line, and knows which tasks are in flight
for a checkpoint. Every state change wakes the waiters, and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from unified.advantages import compute_advantages, max_variance_subset
from unified.checkpoint import LedgerEntry, Outcome, TrainerState
from unified.config import TrainerConfig
from unified.coordinator import SyncCoordinator
from unified.data import TaskSampler
from unified.types import Episode, Task, TrajectoryGroup
from unified.waiting import Changes

__all__ = ["RUN_ENDED", "EndedGroup", "GroupTicket", "Outcome", "TrajectoryGroupBuffer"]

log = logging.getLogger(__name__)

RUN_ENDED = "was still alive when the run ended"
"""In the ledger reason of a group requeued after the run's last step (`end_run`)."""

_DISCARDED = ("episodes/discarded", "episodes/cancelled", "tokens/discarded")


@dataclass(frozen=True, order=True)
class GroupTicket:
    """A dispatched group: ordered by (dispatch version, dispatch sequence number)."""

    version: int
    seq: int
    group_id: str = field(compare=False)
    task_id: str = field(compare=False)
    # The rewards of all its usable episodes, set when it ends ready: with `keep_per_group` the
    # group trains on fewer, and the reward metrics still cover every one.
    rewards: tuple[float, ...] = field(default=(), compare=False)
    # Every episode it finished, set when it ends ready: the rollout records show them all.
    episodes: tuple[Episode, ...] = field(default=(), compare=False)
    dispatched: float = field(default=0.0, compare=False)
    """Wall-clock time of its dispatch (`time.time()`), for the rollout records' timeline."""
    task: Task | None = field(default=None, compare=False)


@dataclass(frozen=True)
class EndedGroup:
    """A group that ended untrained: what the ledger and the metrics record about it."""

    ticket: GroupTicket
    outcome: Outcome
    policy_version: int
    reason: str
    rewards: tuple[float, ...]
    episodes: tuple[Episode, ...] = ()
    """The episodes it finished (the rollout records show them)."""


class TrajectoryGroupBuffer:
    """Admits groups, collects their episodes, decides each group's one outcome, holds the ready.

    `ledger` appends ledger lines (blocking; it is called from a worker thread).
    """

    def __init__(
        self,
        coordinator: SyncCoordinator,
        tasks: TaskSampler,
        ledger: Callable[[list[LedgerEntry]], None],
        *,
        group_size: int,
        advantage: str,
        filter_groups: bool,
        stall_timeout_s: float,
        keep_per_group: int | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.group_size = group_size
        self.keep_per_group = keep_per_group
        self.advantage = advantage
        self.filter_groups = filter_groups
        self.next_seq = 0
        self.unproductive_in_a_row = 0
        self.failed_in_a_row = 0  # of those, the groups that failed (the rest were filtered)
        self.last_unproductive_reason = ""
        # Generation thrown away by requeued groups, since the last `take_discarded`.
        self._discarded = dict.fromkeys(_DISCARDED, 0.0)
        self._sampler = tasks
        self._ledger = ledger
        # Tasks to dispatch before new ones, with their sequence number (None: a new one).
        self._redispatch: deque[tuple[Task, int | None]] = deque()
        # Every dispatched group not yet ended, by group id: its task and sequence number.
        self._tasks: dict[str, tuple[Task, int]] = {}
        self._episodes: dict[str, list[Episode]] = {}  # groups still generating
        self._rollouts: dict[str, tuple[GroupTicket, list[asyncio.Task[None]]]] = {}
        # The groups still generating and their unfinished episodes, by dispatch version: what
        # admission by count reads, without a pass over every group.
        self._generating_at: Counter[int] = Counter()
        self._running_at: Counter[int] = Counter()
        self._ready: list[tuple[GroupTicket, TrajectoryGroup]] = []  # a heap, oldest first
        self._ended: list[EndedGroup] = []
        self._changes = Changes(stall_timeout_s, self.describe)
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0
        self.in_flight_at_end = {"episodes": 0.0, "tokens": 0.0}
        """Finished episodes (and their tokens) of the groups still alive when the run ended:
        their tasks are the final checkpoint's groups in flight, dispatched first on resume."""

    @classmethod
    def for_config(
        cls,
        config: TrainerConfig,
        tasks: Sequence[Task],
        ledger: Callable[[list[LedgerEntry]], None],
    ) -> TrajectoryGroupBuffer:
        """The buffer of a run: its coordinator, and its task order from `trainer.seed`."""
        settings = config.trainer
        return cls(
            SyncCoordinator.for_config(config),
            TaskSampler(tasks, seed=settings.seed),
            ledger,
            group_size=settings.group_size,
            advantage=settings.advantage,
            filter_groups=settings.filter_groups,
            stall_timeout_s=settings.stall_timeout_s,
            keep_per_group=settings.keep_per_group,
        )

    @property
    def version(self) -> int:
        """The policy version serving sampling (new groups are stamped with it)."""
        return self.coordinator.version

    @property
    def alive(self) -> int:
        """Groups dispatched and not yet taken for training or ended."""
        return self.coordinator.alive

    # -- admission ------------------------------------------------------------------------------

    def can_admit(self, max_concurrency: int) -> bool:
        """Whether one more group may be dispatched now; while a whole group would find free
        workflow slots (of `max_concurrency`), the strict rule may admit beyond the bound."""
        c = self.coordinator
        if not c.strict:
            return c.can_admit(pending=self.pending)
        return c.can_admit(spare=self.episodes_running + self.group_size <= max_concurrency)

    @property
    def episodes_running(self) -> int:
        """Episodes of dispatched groups not yet finished (running, or waiting for a slot)."""
        return sum(self._running_at.values())

    @property
    def pending(self) -> float:
        """Work admitted and not yet taken, in groups, as admission by count bounds it: a ready
        group counts one, and so does a group still generating, but for its running episodes'
        share only (`running / group_size`) once it is late (its deadline has passed) or while
        no group is ready (the trainer waits on generation: finished episodes that wait on
        their group's slowest ones then only keep the engine from new work)."""
        pending = float(len(self._ready))
        if not self._ready:
            return pending + self.episodes_running / self.group_size
        late_before = self.coordinator.version - self.coordinator.max_staleness
        for version, groups in self._generating_at.items():
            if version < late_before:
                pending += self._running_at[version] / self.group_size
            else:
                pending += groups
        return pending

    def _finished_running(self, version: int, episodes: int) -> None:
        """`episodes` of a group dispatched at `version` stopped running (done or cut)."""
        self._running_at[version] -= episodes

    def dispatch(self) -> tuple[GroupTicket, Task]:
        """Admit one group (call only when `can_admit(...)`); return it and its task."""
        if self._redispatch:
            task, old_seq = self._redispatch.popleft()
            seq = self._new_seq() if old_seq is None else old_seq
        else:
            task, seq = self._sampler.next(), self._new_seq()
        ticket = GroupTicket(
            self.coordinator.admit(),
            seq,
            f"g{seq:06d}-{task.id}",
            task.id,
            dispatched=time.time(),
            task=task,
        )
        self._tasks[ticket.group_id] = (task, seq)
        self._episodes[ticket.group_id] = []
        self._rollouts[ticket.group_id] = (ticket, [])
        self._generating_at[ticket.version] += 1
        self._running_at[ticket.version] += self.group_size
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        return ticket, task

    def generating(self, ticket: GroupTicket) -> bool:
        """Whether the group of `ticket` still collects episodes (not ended, not requeued)."""
        return ticket.group_id in self._episodes

    def running(self, ticket: GroupTicket, rollouts: list[asyncio.Task[None]]) -> None:
        """The tasks that run the episodes of a just dispatched group (cancelled if it expires)."""
        self._rollouts[ticket.group_id][1].extend(rollouts)

    def want_steps(self, steps: int, *, taken: int = 0) -> None:
        """Admit no more groups than `steps` more optimizer steps train (`taken` of the first
        one's groups are taken already), beside the coordinator's allowance."""
        self.coordinator.wanted = max(0, steps * self.coordinator.batch_size - taken)
        self._notify()

    def after_step(self, step: int) -> int | None:
        """Optimizer step `step` is done: the version to sync the weights to now (then call
        `open_window` with it), or None."""
        version = self.coordinator.after_step(step)
        if version is None:
            self._expire()
        return version

    def open_window(self, version: int) -> None:
        """Weights of `version` serve sampling now; a new window of admission slots opens, and
        groups that can no longer train within `max_staleness` are requeued."""
        self.coordinator.open_window(version)
        self._expire()

    def _expire(self) -> None:
        c = self.coordinator
        why = f"missed its deadline (weights at {c.version}, max_staleness {c.max_staleness})"
        c.note_wasted(self._requeue_where(c.expired, why))
        self._notify()

    def end_run(self) -> None:
        """The run trained its last step: the groups still alive, admitted beyond what it
        needed, end requeued; a resumed run dispatches their tasks first. Their generation is
        the final checkpoint's work in flight (`in_flight_at_end`), not thrown away as late."""
        self._requeue_where(lambda version: True, RUN_ENDED, late=False)

    def _requeue_where(
        self, requeued: Callable[[int], bool], why: str, *, late: bool = True
    ) -> int:
        """Requeue the groups whose dispatch version is `requeued`; return how many were ready."""
        for ticket, rollouts in [r for r in self._rollouts.values() if requeued(r[0].version)]:
            for rollout in rollouts:
                rollout.cancel()
            episodes = self._episodes[ticket.group_id]
            self._requeue(ticket, why, episodes, late=late)
        ready = 0
        while self._ready and requeued(self._ready[0][0].version):  # a heap: oldest first
            ticket, group = heapq.heappop(self._ready)
            self._requeue(ticket, why, group.episodes, late=late)
            ready += 1
        return ready

    def _requeue(
        self, ticket: GroupTicket, why: str, episodes: Sequence[Episode], *, late: bool
    ) -> None:
        self.coordinator.release(ticket.version)
        task, _ = self._tasks.pop(ticket.group_id)
        self._redispatch.append((task, None))
        finished = len(episodes) if ticket.group_id in self._episodes else self.group_size
        tokens = float(sum(e.completion_tokens for e in episodes))
        if late:
            self._discarded["episodes/discarded"] += finished
            self._discarded["episodes/cancelled"] += self.group_size - finished
            self._discarded["tokens/discarded"] += tokens
        else:
            self.in_flight_at_end["episodes"] += finished
            self.in_flight_at_end["tokens"] += tokens
        if ticket.group_id in self._episodes:  # still generating: its unfinished ones are cut
            self._finished_running(ticket.version, self.group_size - finished)
            self._stop_generating(ticket)
        reason = (
            f"dispatched at version {ticket.version}, {why} with {finished} of "
            f"{self.group_size} episodes done; its task is dispatched again"
        )
        self._ended.append(
            EndedGroup(ticket, "requeued", ticket.version, reason, (), tuple(episodes))
        )

    def take_discarded(self) -> dict[str, float]:
        """Generation of groups requeued as late since the last call: episodes finished and
        thrown away (`episodes/discarded`) with their tokens (`tokens/discarded`), or cancelled
        while running (`episodes/cancelled`)."""
        discarded = dict(self._discarded)
        self._discarded = dict.fromkeys(discarded, 0.0)
        return discarded

    # -- episodes and outcomes ------------------------------------------------------------------

    def add_episode(self, ticket: GroupTicket, episode: Episode) -> None:
        """One finished episode; the group ends when its `group_size`-th episode arrives."""
        episodes = self._episodes[ticket.group_id]
        self._finished_running(ticket.version, 1)
        episodes.append(episode)
        if len(episodes) < self.group_size:
            c = self.coordinator
            if not c.strict and c.can_admit(pending=self.pending):
                self._notify()  # a finished episode frees capacity: the dispatcher may admit
            elif c.strict and c.can_admit(spare=True) and not c.can_admit():
                self._notify()  # a slot freed: the dispatcher may admit beyond the bound
            else:
                self._changes.progressed()  # progress for the stall clock, short of a change
            return
        self._stop_generating(ticket)
        episodes.sort(key=lambda e: e.rollout_index)
        self._end(ticket, episodes)
        self._notify()

    def _stop_generating(self, ticket: GroupTicket) -> None:
        """The group collects no more episodes (all in, or requeued)."""
        del self._episodes[ticket.group_id]
        self._rollouts.pop(ticket.group_id, None)
        self._generating_at[ticket.version] -= 1
        if not self._generating_at[ticket.version]:  # and so none of its episodes is running
            assert not self._running_at[ticket.version], self._running_at
            del self._generating_at[ticket.version], self._running_at[ticket.version]
        if not self._episodes:
            self._idle_since = time.monotonic()

    def _end(self, ticket: GroupTicket, episodes: list[Episode]) -> None:
        usable = [e for e in episodes if e.status == "ok"]
        oldest = min([ticket.version, *(e.oldest_version for e in usable)])
        rewards = [e.reward for e in usable]
        if len(usable) < min(2, self.group_size):
            reason = f"{len(episodes) - len(usable)} of {len(episodes)} episodes failed"
            ended = EndedGroup(ticket, "failed", oldest, reason, tuple(rewards), tuple(episodes))
            self._end_untrained(ended)
        elif self.filter_groups and len(usable) > 1 and max(rewards) == min(rewards):
            reason = f"all rewards {rewards[0]:g}"
            ended = EndedGroup(ticket, "filtered", oldest, reason, tuple(rewards), tuple(episodes))
            self._end_untrained(ended)
        else:
            self.unproductive_in_a_row = self.failed_in_a_row = 0
            kept = usable
            if self.keep_per_group is not None:
                kept = [usable[i] for i in max_variance_subset(rewards, self.keep_per_group)]
            group = TrajectoryGroup(
                task_id=ticket.task_id,
                episodes=kept,
                advantages=compute_advantages(self.advantage, [e.reward for e in kept]),
                policy_version=oldest,
                group_id=ticket.group_id,
            )
            done = replace(ticket, rewards=tuple(rewards), episodes=tuple(episodes))
            heapq.heappush(self._ready, (done, group))

    def _end_untrained(self, ended: EndedGroup) -> None:
        self.unproductive_in_a_row += 1
        self.failed_in_a_row += ended.outcome == "failed"
        self.last_unproductive_reason = f"{ended.outcome}: {ended.reason}"
        self.coordinator.release(ended.ticket.version)
        self._ended.append(ended)

    async def next_ready(self) -> tuple[GroupTicket, TrajectoryGroup]:
        """Wait for the oldest ready group that the staleness arithmetic lets train now."""
        taken: list[tuple[GroupTicket, TrajectoryGroup]] = []

        def ready() -> bool:
            item = self.take_ready()
            if item is not None:
                taken.append(item)
            return item is not None

        await self.wait_until(ready, "a trainable group")
        return taken[0]

    def take_ready(self) -> tuple[GroupTicket, TrajectoryGroup] | None:
        """The oldest ready group, if the staleness arithmetic lets it train now."""
        # may_take is monotone in the version: if the oldest may not train, no newer one may.
        c = self.coordinator
        if not self._ready or not c.may_take(self._ready[0][0].version):
            # Held by a group still generating (a due one, or any: nothing is ready), not by a
            # full window: one more group beyond the bound may help.
            if c.taken < c.slots_per_window and self._episodes:
                extra = c.extra
                c.note_blocked()
                if c.extra != extra:
                    self._notify()  # the dispatcher may admit one more
            return None
        ticket, group = heapq.heappop(self._ready)
        self.coordinator.take(ticket.version)
        self._notify()
        return ticket, group

    async def write_ended(self, step: int) -> list[EndedGroup]:
        """Write the ledger lines of groups that ended untrained since the last call (in `step`)."""
        ended, self._ended = self._ended, []
        version = self.coordinator.version
        lines = [
            _line(e.ticket, e.outcome, step, e.policy_version, version, e.reason) for e in ended
        ]
        if lines:
            await asyncio.to_thread(self._ledger, lines)
        for e in ended:
            # Until its line is written a group counts as in flight: resume dispatches it again.
            # (A requeued group's task already waits to be dispatched again.)
            self._tasks.pop(e.ticket.group_id, None)
        return ended

    async def write_trained(
        self,
        items: Sequence[tuple[GroupTicket, TrajectoryGroup]],
        step: int,
        version: int,
        *,
        reason: str = "",
    ) -> None:
        """`items` were trained in `step` onto the weights of `version`: they end here.

        `reason` notes a step whose update the backend skipped (NaN/inf loss or gradient)."""
        lines = [_line(t, "trained", step, g.policy_version, version, reason) for t, g in items]
        await asyncio.to_thread(self._ledger, lines)
        for ticket, _ in items:
            del self._tasks[ticket.group_id]

    # -- checkpoints ----------------------------------------------------------------------------

    def in_flight(self) -> list[tuple[str, int | None]]:
        """(task id, sequence number) of the groups to dispatch again on resume, in dispatch
        order: dispatched groups not yet ended, then those still waiting to be dispatched again."""
        return [(task.id, seq) for task, seq in [*self._tasks.values(), *self._redispatch]]

    def checkpoint_state(self, step: int, ledger_lines: int) -> TrainerState:
        """The trainer's state after `step`, with `ledger_lines` written: this buffer's version,
        task order and groups in flight."""
        in_flight = self.in_flight()
        return TrainerState(
            step=step,
            version=self.coordinator.version,
            next_seq=self.next_seq,
            sampler=self._sampler.state_dict(),
            redispatch=[task_id for task_id, _ in in_flight],
            redispatch_seqs=[seq for _, seq in in_flight],
            ledger_lines=ledger_lines,
        )

    def restore_state(self, state: TrainerState, tasks: Sequence[Task]) -> None:
        """Continue where `state` left off: its task order, version and window, and its groups
        in flight dispatched first under their old ids (those whose task is still in `tasks`)."""
        self._sampler.load_state_dict(state.sampler)
        by_id = {task.id: task for task in tasks}
        # Checkpoints written before sequence numbers were kept get new ones.
        seqs: list[int | None] = [*state.redispatch_seqs]
        seqs += [None] * (len(state.redispatch) - len(seqs))
        gone = [i for i in state.redispatch if i not in by_id]
        if gone:  # the dataset changed since the checkpoint: those groups cannot run again
            log.warning(
                "resume: %d group(s) in flight at the checkpoint are not dispatched again: "
                "their tasks are no longer in data.train (first: %r)",
                len(gone),
                gone[0],
            )
        self.restore(
            version=state.version,
            taken=(state.step % self.coordinator.steps_per_window) * self.coordinator.batch_size,
            next_seq=state.next_seq,
            redispatch=[
                (by_id[i], seq) for i, seq in zip(state.redispatch, seqs, strict=True) if i in by_id
            ],
        )

    def restore(
        self,
        *,
        version: int,
        taken: int,
        next_seq: int,
        redispatch: Iterable[tuple[Task, int | None]],
    ) -> None:
        """Continue a run at `version` with `taken` groups trained in its window, sequence
        numbers from `next_seq`, and the groups in flight at the checkpoint dispatched first,
        each under its old sequence number (so its id and rollout seeds) when it has one."""
        self.coordinator.restore(version, taken=taken)
        self.next_seq = next_seq
        self._redispatch.extend(redispatch)
        self._notify()

    def _new_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def take_idle_seconds(self) -> float:
        """Seconds since the last call during which no group was generating."""
        idle = self._idle_s
        if self._idle_since is not None:
            now = time.monotonic()
            idle += now - self._idle_since
            self._idle_since = now
        self._idle_s = 0.0
        return idle

    # -- waiting --------------------------------------------------------------------------------

    async def wait_until(
        self, predicate: Callable[[], bool], what: str, *, stall_clock: bool = True
    ) -> None:
        """Wait until `predicate()` holds (re-checked at every change of this buffer); fail
        after `stall_timeout_s` with no progress, unless `stall_clock=False`."""
        await self._changes.wait_until(predicate, what, stall_clock=stall_clock)

    def describe(self) -> str:
        """Who is where, for error messages: versions, groups generating, ready and taken."""
        c = self.coordinator
        return (
            f"version={c.version}, alive={c.alive}, generating={len(self._episodes)}, "
            f"ready={len(self._ready)}, taken={c.taken}/{c.slots_per_window}"
        )

    def _notify(self) -> None:
        self._changes.changed()


def _line(
    ticket: GroupTicket,
    outcome: Outcome,
    step: int,
    policy_version: int,
    trainer_version: int,
    reason: str = "",
) -> LedgerEntry:
    return LedgerEntry(
        group_id=ticket.group_id,
        task_id=ticket.task_id,
        outcome=outcome,
        step=step,
        policy_version=policy_version,
        trainer_version=trainer_version,
        reason=reason,
    )

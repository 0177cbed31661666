"""SyncCoordinator's admission arithmetic, the group buffer's waits, and the workflow slots."""

from __future__ import annotations

import asyncio
import time

import pytest

from unified.advantages import compute_advantages
from unified.checkpoint import LedgerEntry
from unified.coordinator import SyncCoordinator
from unified.data import TaskSampler
from unified.errors import StallError
from unified.groups import RUN_ENDED, TrajectoryGroupBuffer
from unified.rollout import WorkflowSlots
from unified.testing import bandit_tasks
from unified.types import Episode, ModelOutput, Step, Trajectory


def coordinator(*, strict: bool = True, **kw: int) -> SyncCoordinator:
    """The strict rule unless `strict=False` (admission by count)."""
    args = {"batch_size": 2, "sync_every": 1, "max_staleness": 1}
    args.update(kw)
    return SyncCoordinator(strict=strict, **args)


def buffer(
    c: SyncCoordinator,
    lines: list[LedgerEntry],
    *,
    stall_timeout_s: float = 5.0,
    group_size: int = 2,
    keep_per_group: int | None = None,
) -> TrajectoryGroupBuffer:
    return TrajectoryGroupBuffer(
        c,
        TaskSampler(bandit_tasks(8), seed=0),
        lines.extend,
        group_size=group_size,
        advantage="grpo",
        filter_groups=True,
        stall_timeout_s=stall_timeout_s,
        keep_per_group=keep_per_group,
    )


def episode(index: int, reward: float, version: int = 0) -> Episode:
    out = ModelOutput(
        text="1",
        prompt_ids=[1],
        completion_ids=[49],
        logprobs=[-0.1],
        finish_reason="stop",
        policy_version=version,
    )
    trajectory = Trajectory(steps=[Step(output=out, reward=reward)], reward=reward)
    return Episode(task_id="t", rollout_index=index, trajectories=[trajectory])


@pytest.mark.parametrize(("s", "k", "m", "capacity"), [(0, 1, 8, 8), (3, 1, 8, 32), (1, 2, 16, 64)])
def test_capacity_is_one_plus_staleness_times_sync_every_times_batch(
    s: int, k: int, m: int, capacity: int
) -> None:
    c = coordinator(max_staleness=s, sync_every=k, batch_size=m)
    for _ in range(capacity):
        assert c.can_admit()
        c.admit()
    assert c.alive == capacity and not c.can_admit(), "the next group must wait"


def test_released_group_frees_its_admission_slot() -> None:
    c = coordinator(max_staleness=0)
    for _ in range(2):
        c.admit()
    assert not c.can_admit()
    c.release(0)
    assert c.can_admit(), "a filtered or failed group releases its slot at once"


def test_taken_groups_hold_their_slot_until_the_window_closes() -> None:
    c = coordinator(max_staleness=0)
    for _ in range(2):
        c.admit()
    c.take(0)
    c.take(0)
    assert not c.can_admit(), "trained groups use this window's slots"
    c.open_window(1)
    assert c.can_admit() and c.admit() == 1


def test_newer_group_waits_while_an_older_one_would_miss_its_deadline() -> None:
    c = coordinator(max_staleness=1, batch_size=1)
    c.admit()  # group A, version 0: must train at version <= 1
    c.take(0)  # a first v0 group trained
    c.open_window(1)
    c.admit()  # B, version 1
    c._alive[0] += 1  # an in-flight v0 group, dispatched before the sync
    c._alive_total += 1
    assert not c.may_take(1), "the only slot at v1 belongs to the v0 group's deadline"
    assert c.may_take(0)


def test_extra_groups_are_admitted_only_while_generation_has_spare_capacity() -> None:
    c = coordinator(max_staleness=1, batch_size=2, max_extra=2)  # capacity 4
    for _ in range(4):
        c.admit()
    assert not c.can_admit(spare=True), "no straggler has held the trainer yet"
    c.note_blocked()
    c.note_blocked()
    assert c.extra == 1, "one more only once the last one allowed went out"
    assert not c.can_admit(), "without spare capacity the staleness bound holds"
    assert c.can_admit(spare=True), "with spare capacity one more group may go out"
    c.admit()
    c.note_blocked()
    c.admit()
    c.note_blocked()
    assert c.extra == 2 and not c.can_admit(spare=True) and c.surplus == 2, "at most max_extra"


def test_the_allowance_doubles_each_time_the_trainer_waits_with_all_of_it_out() -> None:
    c = coordinator(max_staleness=1, batch_size=4, max_extra=6)  # capacity 8
    for _ in range(8):
        c.admit()
    seen = []
    for _ in range(5):
        c.note_blocked()
        seen.append(c.extra)
        while c.can_admit(spare=True):
            c.admit()
    assert seen == [1, 2, 4, 6, 6], f"doubling from one up to max_extra, got {seen}"
    assert c.surplus == 6


def test_the_allowance_waits_for_all_of_it_to_go_out_before_growing() -> None:
    c = coordinator(max_staleness=1, batch_size=4, max_extra=6)
    c.note_blocked()
    c.note_blocked()
    assert c.extra == 1, "a wait while the last group allowed has not gone out changes nothing"


def test_the_allowance_shrinks_by_one_after_one_plus_staleness_calm_windows() -> None:
    c = coordinator(max_staleness=1, batch_size=4, max_extra=8)
    c.extra = 4
    c.note_wasted(3)
    assert c.extra == 4, "one window's waste may be chance: the change shows two windows on"
    c.note_wasted(1)
    assert c.extra == 3, "two windows in a row wasted groups while the trainer never waited"
    c.note_wasted(2)
    assert c.extra == 3, "the count starts again after a change"
    c.note_wasted(2)
    assert c.extra == 2


def test_a_window_in_which_the_trainer_waited_keeps_the_allowance() -> None:
    c = coordinator(max_staleness=0, batch_size=4, max_extra=8)
    c.extra = 8
    c.note_blocked()
    c.note_wasted(5)
    assert c.extra == 8, "the trainer waited in that window: the groups were not too many"
    c.note_wasted(5)
    assert c.extra == 7, "the next window wasted groups and nobody waited"


def test_a_window_that_wasted_nothing_breaks_the_run_of_calm_windows() -> None:
    c = coordinator(max_staleness=1, batch_size=4, max_extra=8)
    c.extra = 4
    c.note_wasted(2)
    c.note_wasted(0)
    c.note_wasted(2)
    assert c.extra == 4, "calm windows count only in a row"


def test_the_runs_last_groups_get_the_allowance_too_and_a_stop_none() -> None:
    c = coordinator(max_staleness=1, batch_size=4, max_extra=2)  # capacity 8
    c.extra = 2
    c.wanted = 3
    for _ in range(5):
        c.admit()
    assert not c.can_admit(), "without spare capacity no more groups than the run wants"
    assert not c.can_admit(spare=True), "3 wanted and 2 that may expire are out"
    c.release(0)
    assert c.can_admit(spare=True), "the last step should not wait on its slowest group"
    c.wanted = 0
    assert not c.can_admit(spare=True), "after a stop nothing more goes out"


def test_at_zero_staleness_no_group_goes_beyond_the_bound_into_a_full_window() -> None:
    c = coordinator(max_staleness=0, batch_size=1, max_extra=2)
    c.admit()
    c.note_blocked()
    assert c.can_admit(spare=True), "the window has room: one more may race the straggler"
    c.take(0)
    assert not c.can_admit(spare=True), "a full window: a group admitted now could never train"


def test_the_trainer_passes_over_as_many_unfinished_groups_as_will_expire_anyway() -> None:
    c = coordinator(max_staleness=1, batch_size=1, max_extra=1)
    c.admit()
    c.take(0)
    c.open_window(1)
    c.admit()  # an unfinished v0 group, due by the end of this window
    c._alive[0] += 1
    c._alive_total += 1
    assert not c.may_take(1), "no surplus: the v0 group's deadline holds the slot"
    c.note_blocked()
    c.admit()  # one group more than the deadlines hold
    assert c.surplus == 1 and c.may_take(1), "one group will expire anyway: train the ready one"
    c.take(1)
    c.open_window(2)
    assert c.expired(0) and not c.expired(1), "the passed-over v0 group missed its deadline"


def test_sync_mode_is_staleness_zero_with_a_window_of_one_step() -> None:
    from unified.config import load_config

    config = load_config(
        {
            "workflow": "m:f",
            "mode": "sync",
            "trainer": {"batch_size": 3},
            "async": {"sync_every": 4},
        }
    )
    c = SyncCoordinator.for_config(config)
    assert (c.max_staleness, c.steps_per_window, c.capacity) == (0, 1, 3)
    assert c.max_extra == 0, "sync mode never over-admits"


def test_a_group_that_misses_its_deadline_is_requeued_and_its_task_dispatched_again() -> None:
    c = coordinator(max_staleness=0, batch_size=1, max_extra=1)
    lines: list[LedgerEntry] = []
    groups = buffer(c, lines)
    straggler, task = groups.dispatch()
    groups.add_episode(straggler, episode(0, reward=1.0))
    c.note_blocked()  # the trainer waits on it
    assert not c.can_admit() and c.can_admit(spare=True)
    fast, _ = groups.dispatch()  # over-admitted
    for index in range(2):
        groups.add_episode(fast, episode(index, reward=float(index)))
    item = groups.take_ready()
    assert item is not None and item[0] == fast, "the first group ready trains"
    groups.open_window(1)
    assert c.alive == 0, "the straggler's slot is free"
    assert groups.take_discarded() == {
        "episodes/discarded": 1.0,
        "episodes/cancelled": 1.0,
        "tokens/discarded": 1.0,
    }
    assert groups.in_flight()[-1] == (task.id, None), "its task waits, for a new number"
    assert not groups.generating(straggler), "its episodes still running are cut, not added"
    again, again_task = groups.dispatch()
    assert again_task.id == task.id and again.seq == 2 and again.version == 1
    ended = asyncio.run(groups.write_ended(step=1))
    assert [(e.ticket, e.outcome) for e in ended] == [(straggler, "requeued")]
    assert [line.outcome for line in lines] == ["requeued"]


def test_groups_alive_when_the_run_ends_are_requeued_with_a_ledger_line_each() -> None:
    c = coordinator(max_staleness=1, batch_size=1, max_extra=2)
    lines: list[LedgerEntry] = []
    groups = buffer(c, lines)
    ready, ready_task = groups.dispatch()
    running, running_task = groups.dispatch()
    for index in range(2):
        groups.add_episode(ready, episode(index, reward=float(index)))
    groups.add_episode(running, episode(0, reward=1.0))
    groups.end_run()
    assert c.alive == 0 and not groups.generating(running), "both end, the running one is cut"
    assert set(groups.take_discarded().values()) == {0.0}, "work in flight at the end is not late"
    assert groups.in_flight_at_end == {"episodes": 3.0, "tokens": 3.0}
    ended = asyncio.run(groups.write_ended(step=5))
    assert [(e.ticket, e.outcome) for e in ended] == [(running, "requeued"), (ready, "requeued")]
    assert all(RUN_ENDED in line.reason for line in lines), [line.reason for line in lines]
    assert groups.in_flight() == [(running_task.id, None), (ready_task.id, None)], (
        "their tasks go first in a run extended from the final checkpoint, under new numbers"
    )


def test_group_ends_once_and_untrained_ones_free_their_slot() -> None:
    c = coordinator(max_staleness=0)
    lines: list[LedgerEntry] = []
    groups = buffer(c, lines)
    filtered, _ = groups.dispatch()
    ready, _ = groups.dispatch()
    assert not c.can_admit()
    for index in range(2):
        groups.add_episode(filtered, episode(index, reward=1.0))
    assert c.can_admit(), "the filtered group freed its slot"
    groups.add_episode(ready, episode(0, reward=0.0))
    groups.add_episode(ready, episode(1, reward=1.0))
    item = groups.take_ready()
    assert item is not None and item[0] == ready
    assert groups.take_ready() is None, "a group is taken once"
    assert groups.in_flight() == [(filtered.task_id, filtered.seq), (ready.task_id, ready.seq)], (
        "until their ledger lines are written both count as in flight"
    )


def test_a_group_trains_on_the_rollouts_its_rewards_spread_most_and_reports_them_all() -> None:
    groups = buffer(coordinator(), [], group_size=6, keep_per_group=4)
    ticket, _ = groups.dispatch()
    rewards = [0.5, 0.0, 1.0, 0.4, 0.0, 0.9]
    for index, reward in enumerate(rewards):
        groups.add_episode(ticket, episode(index, reward))
    item = groups.take_ready()
    assert item is not None
    ready, group = item
    assert [e.rollout_index for e in group.episodes] == [1, 2, 4, 5], "the two lowest, two highest"
    assert group.advantages == pytest.approx(compute_advantages("grpo", [0.0, 1.0, 0.0, 0.9]))
    assert ready.rewards == tuple(rewards), "reward metrics cover every rollout"


async def test_ended_groups_leave_in_flight_when_their_line_is_written() -> None:
    lines: list[LedgerEntry] = []
    groups = buffer(coordinator(max_staleness=0), lines)
    ticket, _ = groups.dispatch()
    for index in range(2):
        groups.add_episode(ticket, episode(index, reward=1.0))
    ended = await groups.write_ended(step=1)
    assert [e.outcome for e in ended] == ["filtered"]
    assert [(e.group_id, e.outcome, e.step) for e in lines] == [(ticket.group_id, "filtered", 1)]
    assert groups.in_flight() == []


async def test_wait_without_progress_fails_with_a_stall_error_that_says_who_waits() -> None:
    groups = buffer(coordinator(), [], stall_timeout_s=0.05)
    groups.dispatch()
    with pytest.raises(StallError, match=r"a trainable group.*alive=1, generating=1"):
        await groups.next_ready()


async def test_episodes_finishing_one_by_one_keep_the_stall_clock_from_firing() -> None:
    groups = buffer(coordinator(), [], stall_timeout_s=0.1)
    ticket, _ = groups.dispatch()

    async def one_by_one() -> None:
        for index in range(2):  # the group ends 0.16 s in: past the clock, progressing all along
            await asyncio.sleep(0.08)
            groups.add_episode(ticket, episode(index, reward=float(index)))

    async with asyncio.timeout(5), asyncio.TaskGroup() as group:
        group.create_task(one_by_one())
        taken, _ = await groups.next_ready()
    assert taken == ticket


async def test_admission_outwaits_the_stall_clock_while_the_trainer_is_busy() -> None:
    c = coordinator(max_staleness=0)
    groups = buffer(c, [], stall_timeout_s=0.05)
    tickets = [groups.dispatch()[0] for _ in range(2)]
    waiter = asyncio.create_task(groups.wait_until(c.can_admit, "a slot", stall_clock=False))
    done, _ = await asyncio.wait([waiter], timeout=0.2)  # four stall periods pass
    assert not done, "a busy trainer (eval, save) must not fail the dispatcher"
    for index in range(2):
        groups.add_episode(tickets[0], episode(index, reward=1.0))
    async with asyncio.timeout(5):
        await waiter


async def test_max_concurrency_bounds_running_workflows() -> None:
    slots = WorkflowSlots(max_concurrency=2)
    peak = 0
    release = asyncio.Event()

    async def workflow() -> None:
        nonlocal peak
        async with slots:
            peak = max(peak, slots.running)
            await release.wait()

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        for _ in range(5):
            tg.create_task(workflow())
        await asyncio.sleep(0)
        assert slots.running == 2
        release.set()
    assert peak == 2


async def test_dispatch_rate_spaces_workflow_starts() -> None:
    rate = 40.0
    slots = WorkflowSlots(max_concurrency=8, dispatch_rate=rate)
    starts: list[float] = []

    async def workflow() -> None:
        async with slots:
            starts.append(time.monotonic())

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        for _ in range(6):
            tg.create_task(workflow())
    elapsed = starts[-1] - starts[0]
    assert elapsed >= (len(starts) - 1) / rate * 0.9, f"6 starts took only {elapsed:.3f} s"


def test_counting_a_group_holds_one_slot_until_its_deadline_then_its_running_share() -> None:
    c = coordinator(strict=False, max_staleness=1, batch_size=1)  # capacity 2
    groups = buffer(c, [], group_size=2)
    straggler, _ = groups.dispatch()
    groups.add_episode(straggler, episode(0, reward=1.0))  # one of its two episodes is done
    assert groups.pending == 0.5, "nothing ready (the trainer waits): its running share only"
    ready, _ = groups.dispatch()
    for index in range(2):
        groups.add_episode(ready, episode(index, reward=float(index)))
    assert groups.pending == 2.0, "with a group ready, an on-time group holds a whole slot"
    assert not groups.can_admit(max_concurrency=64), "two groups fill a capacity of two"
    c.open_window(1)
    c.open_window(2)  # the straggler's deadline (0 + 1) has passed
    assert not c.expired(straggler.version), "counting requeues nothing"
    assert groups.pending == 1.0 + 0.5, "a late group holds only its running episodes' share"
    assert groups.can_admit(max_concurrency=64), "so the engine gets new work"
    assert groups.generating(straggler), "and the straggler still runs, to train later"

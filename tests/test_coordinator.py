"""SyncCoordinator: admission capacity, deadline-aware taking, slots freed, drain, rate limit."""

from __future__ import annotations

import asyncio
import time

import pytest

from unified.coordinator import SyncCoordinator
from unified.errors import StallError


def coordinator(**kw: object) -> SyncCoordinator:
    args: dict[str, object] = {
        "batch_size": 2,
        "sync_every": 1,
        "max_staleness": 1,
        "max_concurrency": 8,
        "stall_timeout": 5.0,
    }
    args.update(kw)
    return SyncCoordinator(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("s", "k", "m", "capacity"), [(0, 1, 8, 8), (3, 1, 8, 32), (1, 2, 16, 64)])
async def test_capacity_is_one_plus_staleness_times_sync_every_times_batch(
    s: int, k: int, m: int, capacity: int
) -> None:
    c = coordinator(max_staleness=s, sync_every=k, batch_size=m)
    for _ in range(capacity):
        await c.admit()
    assert c.alive == capacity and not c.can_dispatch(), "the next group must wait"


async def test_filtered_group_frees_its_admission_slot() -> None:
    c = coordinator(max_staleness=0)
    for _ in range(2):
        await c.admit()
    assert not c.can_dispatch()
    c.resolve(0)
    assert c.can_dispatch(), "a filtered or failed group releases its slot at once"


async def test_taken_groups_hold_their_slot_until_the_weight_sync() -> None:
    c = coordinator(max_staleness=0)
    for _ in range(2):
        await c.admit()
    c.take(0)
    c.take(0)
    assert not c.can_dispatch(), "trained groups use this version's slots"
    c.synced(1)
    assert c.can_dispatch() and await c.admit() == 1


async def test_newer_group_waits_while_an_older_one_would_miss_its_deadline() -> None:
    c = coordinator(max_staleness=1, batch_size=1)
    await c.admit()  # group A, version 0: must train at version <= 1
    c.take(0)  # a first v0 group trained
    c.synced(1)
    await c.admit()  # B, version 1 (A's sibling from v0 is still alive below)
    c._alive[0] += 1  # an in-flight v0 group, dispatched before the sync
    assert not c.may_take(1), "the only slot at v1 belongs to the v0 group's deadline"
    assert c.may_take(0)


async def test_pause_blocks_admission_until_resume() -> None:
    c = coordinator()
    c.pause()
    waiter = asyncio.create_task(c.admit())
    await asyncio.sleep(0)
    assert not waiter.done()
    c.resume()
    async with asyncio.timeout(5):
        assert await waiter == 0


async def test_drain_waits_for_generating_groups() -> None:
    c = coordinator()
    await c.admit()
    drained = asyncio.create_task(c.drain())
    await asyncio.sleep(0)
    assert not drained.done()
    c.generated()
    async with asyncio.timeout(5):
        await drained


async def test_wait_without_progress_fails_with_a_stall_error() -> None:
    c = coordinator(stall_timeout=0.05)
    with pytest.raises(StallError, match="in-flight groups"):
        await c.admit()
        await c.drain()


async def test_max_concurrency_bounds_running_workflows() -> None:
    c = coordinator(max_concurrency=2)
    peak = 0
    release = asyncio.Event()

    async def workflow() -> None:
        nonlocal peak
        async with c.workflow_slot():
            peak = max(peak, c.running)
            await release.wait()

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        for _ in range(5):
            tg.create_task(workflow())
        await asyncio.sleep(0)
        assert c.running == 2
        release.set()
    assert peak == 2


async def test_dispatch_rate_spaces_workflow_starts() -> None:
    rate = 40.0
    c = coordinator(dispatch_rate=rate)
    starts: list[float] = []

    async def workflow() -> None:
        async with c.workflow_slot():
            starts.append(time.monotonic())

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        for _ in range(6):
            tg.create_task(workflow())
    elapsed = starts[-1] - starts[0]
    assert elapsed >= (len(starts) - 1) / rate * 0.9, f"6 starts took only {elapsed:.3f} s"


async def test_admission_outwaits_the_stall_clock_while_the_consumer_is_busy() -> None:
    c = coordinator(max_staleness=0, stall_timeout=0.05)
    for _ in range(2):
        await c.admit()
    waiter = asyncio.create_task(c.admit())
    done, _ = await asyncio.wait([waiter], timeout=0.2)  # four stall periods pass
    assert not done, "a busy consumer (eval, save) must not fail the producer"
    c.resolve(0)
    async with asyncio.timeout(5):
        assert await waiter == 0

"""The turns by which one vLLM engine serves every snapshot of the local Tinker server
(`tinker_server/vllm_sampling.py`), on a fake engine: no request ever runs while another
snapshot's weights are loaded, a reload never overlaps a request, and every request ends."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinker_server.vllm_sampling import _Turns
from torchkit.vllm_engine import VllmSampler


class FakeEngine:
    """Records what is loaded and running; a load takes a few ticks of the event loop."""

    def __init__(self) -> None:
        self.loaded = 0
        self.running = 0
        self.loads = 0

    async def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        assert self.running == 0, f"a reload to {version} began with {self.running} running"
        self.loaded = -1  # mid-load: neither the old nor the new weights
        for _ in range(3):
            await asyncio.sleep(0)
        assert self.running == 0, f"a request started during the reload to {version}"
        self.loaded, self.loads = version, self.loads + 1


requests = st.lists(
    st.tuples(
        st.integers(0, 3),  # the snapshot it names
        st.integers(0, 5),  # ticks before it arrives
        st.integers(0, 5),  # ticks it runs
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_every_request_runs_on_its_snapshots_weights_and_ends(
    plan: list[tuple[int, int, int]],
) -> None:
    engine = FakeEngine()
    turns = _Turns(cast(VllmSampler, engine))
    weights: dict[str, Any] = {}

    async def request(version: int, arrival: int, duration: int) -> None:
        for _ in range(arrival):
            await asyncio.sleep(0)
        async with turns.turn(version, weights):
            engine.running += 1
            for _ in range(duration + 1):
                assert engine.loaded == version, f"snapshot {version} ran on {engine.loaded}"
                await asyncio.sleep(0)
            engine.running -= 1

    async def run_all() -> None:
        async with asyncio.timeout(10):
            async with asyncio.TaskGroup() as group:
                for version, arrival, duration in plan:
                    group.create_task(request(version, arrival, duration))

    asyncio.run(run_all())
    assert engine.loads <= len(plan), f"{engine.loads} reloads for {len(plan)} requests"
    if all(version == 0 for version, _, _ in plan):
        assert engine.loads == 0, "the engine starts on the base weights: nothing to reload"


def test_requests_alternating_between_snapshots_gather_into_one_turn_each() -> None:
    engine = FakeEngine()
    turns = _Turns(cast(VllmSampler, engine))
    order: list[int] = []

    async def request(version: int) -> None:
        async with turns.turn(version, {}):
            order.append(version)
            await asyncio.sleep(0)

    async def run_all() -> None:
        async with asyncio.timeout(10), asyncio.TaskGroup() as group:
            for version in [1, 2] * 4:
                group.create_task(request(version))

    asyncio.run(run_all())
    # 1 runs first; its later requests queue behind 2's turn, which was waiting before them.
    assert order == [1, 2, 2, 2, 2, 1, 1, 1], order
    assert engine.loads == 3, f"{engine.loads} reloads: one per turn (1, 2, 1)"

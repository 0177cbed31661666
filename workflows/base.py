"""The `Workflow` base class: what a user implements to teach the policy a task.

The trainer makes a fresh instance per episode and awaits `run(task, model)`; many run at once on
one event loop, so `run` must not block (wrap blocking tools in `asyncio.to_thread`). Return one
`Trajectory` with one `Step` per model call. A raised exception is recorded as a failed episode,
not retried. Plain `async def fn(task, model) -> Trajectory` functions work as workflows too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from unified.protocol import RolloutEngine
from unified.types import Task, Trajectory

__all__ = ["Workflow"]


class Workflow(ABC):
    """One rollout of an agent on a task: call `model`, score the result, return a trajectory."""

    required_fields: ClassVar[tuple[str, ...]] = ()
    """Keys of `task.data` that `run` reads: every task is checked for them before the run
    starts, so a dataset that lacks one fails in one line instead of in every episode."""

    @abstractmethod
    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        """Run the agent on `task`, sampling from `model`; return its scored trajectory."""

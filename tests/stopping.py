"""Test-only: a bandit workflow that sends its own process a signal at a chosen episode.

In-process tests pass the settings; a CLI run (`workflow: tests.stopping:InterruptingWorkflow`)
reads them from `UNIFIED_TEST_STOP_AT` (0-based episode index), `UNIFIED_TEST_STOP_SIGNAL`
(a number; none: send nothing) and `UNIFIED_TEST_STOP_HANG_S`. The episode prints `stop point`
to stderr, then waits `hang_s` (a group that misses the stop grace) before it answers.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import Iterator
from typing import ClassVar

from unified.protocol import RolloutEngine
from unified.testing import BanditWorkflow
from unified.types import Task, Trajectory


class InterruptingWorkflow(BanditWorkflow):
    """`BanditWorkflow` that signals its process (and may hang) at episode `at`."""

    # The trainer makes a fresh instance per episode from a class path: they count together.
    _episodes: ClassVar[Iterator[int]] = itertools.count()

    def __init__(
        self, at: int | None = None, signal_number: int | None = None, hang_s: float = 0.0
    ) -> None:
        env = os.environ
        self.at = at if at is not None else int(env.get("UNIFIED_TEST_STOP_AT", "-1"))
        signal_env = env.get("UNIFIED_TEST_STOP_SIGNAL")
        self.signal_number = signal_number or (int(signal_env) if signal_env else None)
        self.hang_s = hang_s or float(env.get("UNIFIED_TEST_STOP_HANG_S", "0"))
        if at is not None:
            self._episodes = itertools.count()  # an instance passed in counts on its own

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        if next(self._episodes) == self.at:
            print("stop point", file=sys.stderr, flush=True)
            if self.signal_number is not None:
                os.kill(os.getpid(), self.signal_number)
            await asyncio.sleep(self.hang_s)
        return await super().run(task, model)

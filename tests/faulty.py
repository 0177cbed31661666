"""Test-only fault injectors on top of the bandit: buggy workflows, broken replies, stuck calls.

Not product code: the injectors users may use (`FlakyWorkflow`, `StuckOptimStep`) live in
`unified.testing`. Config names these by import path (`workflow: tests.faulty:BuggyWorkflow`,
`backend: tests.faulty:StringMetric`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from typing import Any

from unified.protocol import RolloutEngine
from unified.testing import BanditBackend, BanditWorkflow
from unified.types import ModelOutput, Step, Task, Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


class BuggyWorkflow:
    """A workflow with a bug of its own in every run: the user needs its traceback."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        return _score(task.data)


def _score(data: dict[str, Any]) -> Trajectory:
    return Trajectory(steps=[], reward=1 / (data["target"] - data["target"]))


class LeakyWorkflow(BanditWorkflow):
    """Logs and raises with the API key in the message, as a careless HTTP client might."""

    fail = False

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        key = os.environ.get("TINKER_API_KEY", "")
        log.warning("calling the tool with key %s", key)
        if self.fail:
            raise PermissionError(f"tool refused key {key}")
        return await super().run(task, model)


class LeakyFailingWorkflow(LeakyWorkflow):
    """`LeakyWorkflow` whose every run fails, so the run stops with the key in the error."""

    fail = True


async def _one_step(task: Task, model: RolloutEngine, reward: Any = 1.0) -> Trajectory:
    out = await model.chat([{"role": "user", "content": f"pick {task.data['target']}"}])
    return Trajectory(steps=[Step(messages=[], output=out, reward=0.0)], reward=reward)


async def returns_a_dict(task: Task, model: RolloutEngine) -> Any:
    return {"reward": 1.0}


async def returns_none(task: Task, model: RolloutEngine) -> Any:
    return None


async def returns_an_empty_list(task: Task, model: RolloutEngine) -> Any:
    return []


async def returns_no_steps(task: Task, model: RolloutEngine) -> Trajectory:
    return Trajectory(steps=[], reward=1.0)


async def nan_reward(task: Task, model: RolloutEngine) -> Trajectory:
    return await _one_step(task, model, math.nan)


async def none_reward(task: Task, model: RolloutEngine) -> Trajectory:
    return await _one_step(task, model, None)


async def string_reward(task: Task, model: RolloutEngine) -> Trajectory:
    return await _one_step(task, model, "0.5")


async def huge_reward(task: Task, model: RolloutEngine) -> Trajectory:
    return await _one_step(task, model, 1e30)


async def mismatched_logprobs(task: Task, model: RolloutEngine) -> Trajectory:
    out = await model.chat([{"role": "user", "content": "pick"}])
    bad = ModelOutput(**{**out.model_dump(), "logprobs": [*out.logprobs, -0.5]})
    return Trajectory(steps=[Step(messages=[], output=bad)], reward=1.0)


class StuckInThread(BanditBackend):
    """`optim_step` blocks in a worker thread that never returns (a wedged device call), as the
    local backend runs its updates in `asyncio.to_thread`."""

    release = threading.Event()

    async def optim_step(self) -> dict[str, float]:
        await asyncio.to_thread(self.release.wait, 600)
        raise AssertionError("unreachable")


class ListForwardBackward(BanditBackend):
    """`forward_backward` replies with a list instead of a dict of metrics."""

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> Any:
        await super().forward_backward(groups)
        return [1.0, 2.0]


class StringMetric(BanditBackend):
    """`optim_step` replies with a metric that is not a number."""

    async def optim_step(self) -> Any:
        await super().optim_step()
        return {"train/grad_norm": "large"}


class DictEngineReply(BanditBackend):
    """The token sampler replies with a plain dict instead of a `ModelOutput`."""

    def token_sampler(self) -> Any:
        outer = self

        class Sampler:
            backend = outer
            tokenizer = outer.tokenizer

            async def sample(self, prompt_ids: Any, params: Any) -> Any:
                return {"text": "1"}

        return Sampler()


class NanGradient(BanditBackend):
    """Every optimizer step reports a NaN gradient norm (a backend that cannot skip itself)."""

    async def optim_step(self) -> dict[str, float]:
        await super().optim_step()
        return {"train/grad_norm": math.nan}


class NanThenFine(BanditBackend):
    """The first `bad` optimizer steps are skipped for a NaN loss; later ones train normally."""

    bad = 2

    async def optim_step(self) -> dict[str, float]:
        if self.bad > 0:
            self.bad -= 1
            self.grad = [0.0] * self.arms
            return {"train/skipped_steps": 1.0}
        return await super().optim_step()

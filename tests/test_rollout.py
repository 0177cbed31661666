"""The episode runner records failures instead of raising; the sampling view is per request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.bandit import BanditBackend, BanditWorkflow
from unified.errors import UsageError
from unified.protocol import RolloutEngine
from unified.rollout import SamplingEngine, resolve_workflow, run_episode
from unified.types import SamplingParams, Task, Trajectory

TASK = Task(id="t0", data={"target": 1})


def engine(**sampling: Any) -> SamplingEngine:
    return SamplingEngine(BanditBackend().rollout_engine(), SamplingParams(**sampling), seed=7)


async def test_workflow_exception_becomes_an_error_episode_with_its_text() -> None:
    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        raise KeyError("missing field")

    episode, error = await run_episode(
        broken, TASK, engine(), rollout_index=2, version=1, timeout_s=5
    )
    assert episode.status == "error" and episode.error == "KeyError: 'missing field'"
    assert isinstance(error, KeyError) and episode.rollout_index == 2
    assert episode.trajectories == []


async def test_workflow_past_its_timeout_becomes_a_timeout_episode() -> None:
    async def stuck(task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    episode, _ = await run_episode(
        stuck, TASK, engine(), rollout_index=0, version=0, timeout_s=0.05
    )
    assert episode.status == "timeout" and "workflow_timeout" in (episode.error or "")


async def test_workflow_returning_the_wrong_type_is_an_error_episode() -> None:
    async def wrong(task: Task, model: RolloutEngine) -> Any:
        return {"reward": 1.0}

    episode, _ = await run_episode(wrong, TASK, engine(), rollout_index=0, version=0, timeout_s=5)
    assert episode.status == "error" and "must return a Trajectory" in (episode.error or "")


async def test_sampling_view_fills_defaults_and_lets_a_request_override_them() -> None:
    view = engine(temperature=0.7, max_tokens=9)
    backend = view._engine.backend  # type: ignore[attr-defined]
    await view.chat([{"role": "user", "content": "a"}])
    await view.chat([{"role": "user", "content": "b"}], max_tokens=3)
    first, second = backend.requests
    assert (first["temperature"], first["max_tokens"]) == (0.7, 9)
    assert (second["temperature"], second["max_tokens"]) == (0.7, 3)
    assert first["seed"] != second["seed"], "each request gets its own reproducible seed"


async def test_sampling_view_rejects_an_unknown_sampling_keyword() -> None:
    with pytest.raises(ValueError, match="temprature"):
        await engine().chat([{"role": "user", "content": "a"}], temprature=0.1)


def test_resolve_workflow_accepts_paths_classes_instances_and_functions() -> None:
    async def fn(task: Task, model: RolloutEngine) -> Trajectory:
        raise NotImplementedError

    assert resolve_workflow(fn) is fn
    assert callable(resolve_workflow("tests.bandit:BanditWorkflow"))
    assert callable(resolve_workflow(BanditWorkflow))
    assert callable(resolve_workflow(BanditWorkflow()))
    with pytest.raises(UsageError, match="no attribute 'Nope'"):
        resolve_workflow("tests.bandit:Nope")
    with pytest.raises(UsageError, match="not an async function"):
        resolve_workflow(len)

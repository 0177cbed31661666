"""The episode runner records failures instead of raising; the sampling view is per request."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from unified.errors import UsageError
from unified.protocol import RolloutEngine
from unified.rollout import SamplingEngine, WorkflowDeadlines, resolve_workflow, run_episode
from unified.testing import BanditBackend, BanditWorkflow
from unified.types import SamplingParams, Step, Task, Trajectory

TASK = Task(id="t0", data={"target": 1})


def engine(**sampling: Any) -> SamplingEngine:
    return SamplingEngine(BanditBackend().token_sampler(), SamplingParams(**sampling), seed=7)


async def test_workflow_exception_becomes_an_error_episode_with_its_text() -> None:
    async def broken(task: Task, model: RolloutEngine) -> Trajectory:
        raise KeyError("missing field")

    episode, error = await run_episode(
        broken, TASK, engine(), rollout_index=2, version=1, deadlines=WorkflowDeadlines(5)
    )
    assert episode.status == "error" and episode.error == "KeyError: 'missing field'"
    assert isinstance(error, KeyError) and episode.rollout_index == 2
    assert episode.trajectories == []


async def test_workflow_past_its_timeout_becomes_a_timeout_episode() -> None:
    async def stuck(task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    episode, _ = await run_episode(
        stuck, TASK, engine(), rollout_index=0, version=0, deadlines=WorkflowDeadlines(0.05)
    )
    assert episode.status == "timeout" and "workflow_timeout_s" in (episode.error or "")


async def test_workflow_returning_the_wrong_type_is_an_error_episode() -> None:
    async def wrong(task: Task, model: RolloutEngine) -> Any:
        return {"reward": 1.0}

    episode, _ = await run_episode(
        wrong, TASK, engine(), rollout_index=0, version=0, deadlines=WorkflowDeadlines(5)
    )
    assert episode.status == "error" and "must return a Trajectory" in (episode.error or "")


async def test_sampling_view_fills_defaults_and_lets_a_request_override_them() -> None:
    view = engine(temperature=0.7, max_tokens=9)
    backend = view._sampler.backend  # type: ignore[attr-defined]
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
    assert callable(resolve_workflow("unified.testing:BanditWorkflow"))
    assert callable(resolve_workflow(BanditWorkflow))
    assert callable(resolve_workflow(BanditWorkflow()))
    with pytest.raises(UsageError, match="no attribute 'Nope'"):
        resolve_workflow("unified.testing:Nope")
    with pytest.raises(UsageError, match="not an async function"):
        resolve_workflow(len)


async def echo(task: Task, model: RolloutEngine) -> Trajectory:
    out = await model.chat([{"role": "user", "content": task.id}])
    return Trajectory(steps=[Step(output=out)], reward=0.0)


async def test_one_deadline_timer_times_out_only_the_runs_past_their_own_deadline() -> None:
    deadlines = WorkflowDeadlines(0.2)
    release = asyncio.Event()

    async def quick(task: Task, model: RolloutEngine) -> Trajectory:
        await release.wait()
        return await echo(task, model)

    async def stuck(task: Task, model: RolloutEngine) -> Trajectory:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run(workflow: Any) -> str:
        episode, _ = await run_episode(
            workflow, TASK, engine(), rollout_index=0, version=0, deadlines=deadlines
        )
        return episode.status

    async with asyncio.timeout(5):
        first = asyncio.create_task(run(stuck))
        await asyncio.sleep(0.1)
        later = [asyncio.create_task(run(w)) for w in (quick, stuck)]
        assert await first == "timeout"
        assert not any(t.done() for t in later), "runs started later keep their own deadline"
        release.set()
        assert [await t for t in later] == ["ok", "timeout"]


async def test_a_workflow_that_swallows_the_cancellation_still_counts_as_timed_out() -> None:
    async def stubborn(task: Task, model: RolloutEngine) -> Trajectory:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return await echo(task, model)

    episode, error = await run_episode(
        stubborn, TASK, engine(), rollout_index=0, version=0, deadlines=WorkflowDeadlines(0.05)
    )
    assert episode.status == "timeout" and isinstance(error, TimeoutError)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_outside_is_not_turned_into_a_timeout() -> None:
    started = asyncio.Event()

    async def waits(task: Task, model: RolloutEngine) -> Trajectory:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    run = asyncio.create_task(
        run_episode(
            waits, TASK, engine(), rollout_index=0, version=0, deadlines=WorkflowDeadlines(5)
        )
    )
    async with asyncio.timeout(5):
        await started.wait()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_a_cancelled_error_the_workflow_raises_of_its_own_is_an_error_episode() -> None:
    async def lets_one_out(task: Task, model: RolloutEngine) -> Trajectory:
        inner = asyncio.create_task(asyncio.sleep(10))  # a client library's request, cancelled
        await asyncio.sleep(0)
        inner.cancel()
        await inner
        raise AssertionError("unreachable")

    episode, error = await run_episode(
        lets_one_out, TASK, engine(), rollout_index=1, version=0, deadlines=WorkflowDeadlines(5)
    )
    assert episode.status == "error" and "without being cancelled" in (episode.error or "")
    assert isinstance(error, RuntimeError) and isinstance(error.__cause__, asyncio.CancelledError)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

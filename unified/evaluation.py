"""Evaluation: run each eval task once with the eval sampling settings and score the episodes.

Evaluation shares the backend's token sampler with training but never its settings: every eval
request carries `sampling.eval`, so an evaluation in the middle of an async run leaves the
training requests around it untouched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from unified.checkpoint import RunDirectory
from unified.config import TrainerConfig
from unified.data import load_eval_tasks
from unified.errors import ConfigError
from unified.model_provider import resolve_model
from unified.protocol import TokenSampler, check_capabilities, create_backend
from unified.rollout import (
    SamplingEngine,
    WorkflowDeadlines,
    WorkflowFn,
    WorkflowSlots,
    resolve_workflow,
    run_episode,
    workflow_serving,
)
from unified.session import backend_session
from unified.types import Episode, SamplingParams, Task

__all__ = [
    "episode_tool_calls",
    "evaluate",
    "evaluate_for",
    "is_correct",
    "run_eval",
    "tool_call_metrics",
]


def is_correct(episode: Episode) -> bool:
    """Correct if the last step says so (`info["correct"]`), else if the reward is positive."""
    if episode.status != "ok" or not episode.trajectories:
        return False
    steps = episode.trajectories[-1].steps
    if steps and "correct" in steps[-1].info:
        return bool(steps[-1].info["correct"])
    return episode.reward > 0


async def evaluate(
    workflow: WorkflowFn,
    sampler: TokenSampler,
    tasks: Sequence[Task],
    sampling: SamplingParams,
    *,
    seed: int,
    version: int,
    timeout_s: float,
    slots: WorkflowSlots,
    keep: list[tuple[Task, Episode]] | None = None,
) -> dict[str, float]:
    """`eval/accuracy`, `eval/reward`, `eval/errors`, `time/eval` (and the tool-call metrics).

    Each run holds one of `slots`: the trainer passes its own, so evaluation shares
    `max_concurrency` and `dispatch_rate` with training. `keep` gets each task with its episode
    (the trainer records them).
    """
    started = time.monotonic()
    episodes: list[Episode] = []
    deadlines = WorkflowDeadlines(timeout_s)

    async def one(index: int, task: Task) -> None:
        async with slots:
            view = SamplingEngine(sampler, sampling, seed + index)
            episode, _ = await run_episode(
                workflow, task, view, rollout_index=0, version=version, deadlines=deadlines
            )
        episodes.append(episode)
        if keep is not None:
            keep.append((task, episode))

    async with workflow_serving(workflow), asyncio.TaskGroup() as tg:
        for index, task in enumerate(tasks):
            tg.create_task(one(index, task))
    rewards = [e.reward for e in episodes if e.status == "ok"]
    return {
        "eval/accuracy": sum(map(is_correct, episodes)) / max(1, len(episodes)),
        "eval/reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "eval/errors": float(sum(e.status != "ok" for e in episodes)),
        **tool_call_metrics(episodes),
        "time/eval": time.monotonic() - started,
    }


async def evaluate_for(
    config: TrainerConfig,
    workflow: WorkflowFn,
    sampler: TokenSampler,
    tasks: Sequence[Task],
    *,
    version: int,
    slots: WorkflowSlots,
    keep: list[tuple[Task, Episode]] | None = None,
) -> dict[str, float]:
    """`evaluate` with a run's settings: `sampling.eval`, `trainer.seed` and the workflow
    deadline (`trainer.workflow_timeout_s`); the trainer and `unified eval` both call it."""
    return await evaluate(
        workflow,
        sampler,
        tasks,
        config.sampling.eval,
        seed=config.trainer.seed,
        version=version,
        timeout_s=config.trainer.workflow_timeout_s,
        slots=slots,
        keep=keep,
    )


def episode_tool_calls(episode: Episode) -> tuple[int, int] | None:
    """`(calls, failed calls)` of an episode from its steps' `info["tool_calls"]` /
    `["tool_errors"]`; None when its workflow records no tool calls (`ToolWorkflow` does)."""
    infos = [s.info for t in episode.trajectories for s in t.steps]
    if not any("tool_calls" in info for info in infos):
        return None
    calls = sum(int(info.get("tool_calls", 0)) for info in infos)
    return calls, sum(int(info.get("tool_errors", 0)) for info in infos)


def tool_call_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Tool-call metrics of an evaluation (`episode_tool_calls` of each episode).

    `eval/tool_calls`: calls per episode; `eval/tool_calls_well_formed`: the share of calls
    that parsed, named a tool, had valid arguments and ran without error (left out when nothing
    was called); `eval/tool_use`: the share of episodes that called a tool;
    `eval/tool_use_well_formed`: the share of episodes that called one and whose every call was
    well-formed. Empty when no episode's workflow records tool calls.
    """
    recorded = [episode_tool_calls(episode) for episode in episodes]
    if all(r is None for r in recorded):
        return {}
    counted = [r or (0, 0) for r in recorded]
    n = max(1, len(episodes))
    calls = sum(c for c, _ in counted)
    metrics = {
        "eval/tool_calls": calls / n,
        "eval/tool_use": sum(c > 0 for c, _ in counted) / n,
        "eval/tool_use_well_formed": sum(c > 0 and e == 0 for c, e in counted) / n,
    }
    if calls:
        metrics["eval/tool_calls_well_formed"] = 1.0 - sum(e for _, e in counted) / calls
    return metrics


async def run_eval(config: TrainerConfig, *, checkpoint: Path | None = None) -> dict[str, float]:
    """Evaluate `config.model` (or the policy of a checkpoint or run directory) on `data.eval`;
    `eval/step` is the trained step whose policy was scored (0: `config.model` itself).

    What `unified eval` runs: the same `evaluate` the trainer calls, with the config's workflow,
    `sampling.eval`, `eval_limit`, concurrency limits and seed, so its figures match a run's.
    """
    if not config.data.eval:
        raise ConfigError("unified eval needs eval tasks: set data.eval (a file or a generator)")
    workflow = resolve_workflow(config.workflow, config.workflow_args)
    backend = create_backend(config.backend)
    config = await asyncio.to_thread(resolve_model, config)
    tasks = await asyncio.to_thread(load_eval_tasks, config.data)
    source = None
    if checkpoint is not None:
        source = await asyncio.to_thread(RunDirectory.find_checkpoint, checkpoint)
        await asyncio.to_thread(
            RunDirectory.check_matches, source, backend=config.backend, model=config.model
        )
    check_capabilities(config, backend)  # after: a checkpoint of another run says more
    # The trainer's deadlines and retries on every backend call: a stuck backend fails the
    # command instead of hanging it.
    async with backend_session(backend, config, describe="unified eval") as session:
        await session.setup(config, loads_checkpoint=source is not None)
        version = step = 0
        if source is not None:
            state = await RunDirectory.load_checkpoint(source, session.load_checkpoint)
            version, step = state.version, state.step
        slots = WorkflowSlots.for_config(config)
        sampler = backend.token_sampler()
        metrics = await evaluate_for(config, workflow, sampler, tasks, version=version, slots=slots)
        return {**metrics, "eval/step": float(step)}

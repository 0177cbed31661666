"""Supervised fine-tuning (`unified sft`): train any backend with `cross_entropy` on chat data.

Each example is `{"messages": [..., {"role": "assistant", "content": ...}]}`; the model learns
the last assistant message given everything before it, through the same `forward_backward` /
`optim_step` protocol as RL (advantage 1, so `cross_entropy` is plain next-token likelihood).
The result is exported with `backend.export_model` (a Hugging Face directory for `local`).
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import time
from pathlib import Path
from typing import Any

from unified.checkpoint import RunDirectory
from unified.config import TrainerConfig
from unified.data import TaskSampler, load_tasks
from unified.errors import DataError, UsageError
from unified.metrics import MetricsAggregator, metrics_for
from unified.model_provider import resolve_model
from unified.protocol import BackendProtocol, RolloutEngine, check_capabilities, create_backend
from unified.rollout import SamplingEngine
from unified.schedule import learning_rate
from unified.session import BackendSession, backend_session
from unified.types import Episode, ModelOutput, Step, Task, Trajectory, TrajectoryGroup

__all__ = ["example_group", "run_sft"]


def example_group(engine: RolloutEngine, task: Task) -> TrajectoryGroup:
    """One chat example as a one-episode group whose completion is the last assistant turn."""
    messages: Any = task.data.get("messages")
    if (
        not isinstance(messages, list)
        or len(messages) < 2
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        or messages[-1]["role"] != "assistant"
    ):
        raise DataError(
            f"SFT example {task.id!r} must be {{'messages': [..., {{'role': 'assistant', "
            "'content': ...}]}} with at least one message before the assistant reply"
        )
    prompt_ids = engine.encode_chat(messages[:-1], add_generation_prompt=True)
    full_ids = engine.encode_chat(messages, add_generation_prompt=False)
    if full_ids[: len(prompt_ids)] != prompt_ids or len(full_ids) == len(prompt_ids):
        raise DataError(f"SFT example {task.id!r}: the chat template does not extend the prompt")
    completion = full_ids[len(prompt_ids) :]
    output = ModelOutput(
        text=str(messages[-1]["content"]),
        prompt_ids=prompt_ids,
        completion_ids=completion,
        logprobs=[0.0] * len(completion),
        finish_reason="stop",
        policy_version=0,
    )
    step = Step(messages=messages[:-1], output=output, reward=1.0)
    episode = Episode(
        task_id=task.id, rollout_index=0, trajectories=[Trajectory(steps=[step], reward=1.0)]
    )
    return TrajectoryGroup(task_id=task.id, episodes=[episode], advantages=[1.0], policy_version=0)


async def run_sft(
    config: TrainerConfig,
    *,
    output: Path,
    backend: BackendProtocol | None = None,
    examples: list[Task] | None = None,
) -> Path:
    """Train `trainer.total_steps` steps of `trainer.batch_size` examples; export to `output`."""
    config = (await asyncio.to_thread(resolve_model, config)).model_copy(deep=True)
    config.trainer.loss = "cross_entropy"
    backend = backend if backend is not None else create_backend(config.backend)
    check_capabilities(config, backend)
    if getattr(type(backend), "export_model", None) in (None, BackendProtocol.export_model):
        raise UsageError(
            f"unified sft ends by exporting the model, which backend {backend.name!r} cannot do; "
            "fine-tune with backend=local or backend=verl"
        )
    tasks = (
        examples if examples is not None else await asyncio.to_thread(load_tasks, config.data.train)
    )
    sampler = TaskSampler(tasks, seed=config.trainer.seed)
    # A run directory of its own, as training's: never appended to another run's metrics, and
    # removed again if the fine-tuning fails, so that a retry under the name can start.
    run = RunDirectory(config.run_path)
    await asyncio.to_thread(run.create, config.to_yaml(), resume=False)
    try:
        return await _fine_tune(config, backend, sampler, output)
    except BaseException:
        if run.created:
            await asyncio.to_thread(shutil.rmtree, run.path, True)
        raise


async def _fine_tune(
    config: TrainerConfig, backend: BackendProtocol, sampler: TaskSampler, output: Path
) -> Path:
    metrics = await asyncio.to_thread(metrics_for, config)
    try:
        async with backend_session(backend, config, describe="unified sft") as session:
            await _train(config, session, sampler, output, metrics)
    finally:
        await asyncio.to_thread(metrics.close)
    return output


async def _train(
    config: TrainerConfig,
    session: BackendSession,
    sampler: TaskSampler,
    output: Path,
    metrics: MetricsAggregator,
) -> None:
    """`total_steps` cross-entropy steps, each line logged, then the export."""
    backend, calls = session.backend, session.calls
    await session.setup(config)
    engine = SamplingEngine(backend.token_sampler())
    for step in range(config.trainer.total_steps):
        started = time.monotonic()
        groups = [example_group(engine, task) for task in sampler.take(config.trainer.batch_size)]
        metrics.record_many(
            await calls.metrics(
                "forward_backward", functools.partial(backend.forward_backward, groups)
            )
        )
        backend.set_learning_rate(learning_rate(config.trainer, step))
        metrics.record_many(await calls.metrics("optim_step", backend.optim_step))
        values = metrics.flush() | {
            "step": float(step + 1),
            "time/step": time.monotonic() - started,
        }
        await asyncio.to_thread(metrics.log, step + 1, values)
    await calls.call("export_model", functools.partial(backend.export_model, output))

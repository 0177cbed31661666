"""Supervised fine-tuning (`unified sft`): train any backend with `cross_entropy` on chat data.

Each example is `{"messages": [..., {"role": "assistant", "content": ...}]}`; the model learns
the last assistant message given everything before it, through the same `forward_backward` /
`optim_step` protocol as RL (advantage 1, so `cross_entropy` is plain next-token likelihood).
The result is exported with `backend.export_model` (a Hugging Face directory for `local`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from unified.config import TrainerConfig
from unified.data import TaskSampler, load_tasks
from unified.errors import DataError
from unified.metrics import metrics_for
from unified.model_provider import resolve_model
from unified.protocol import BackendProtocol, RolloutEngine, check_capabilities, create_backend
from unified.schedule import learning_rate
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
    tasks = (
        examples if examples is not None else await asyncio.to_thread(load_tasks, config.data.train)
    )
    sampler = TaskSampler(tasks, seed=config.trainer.seed)
    await asyncio.to_thread(config.run_path.mkdir, parents=True, exist_ok=True)
    metrics = await asyncio.to_thread(metrics_for, config)
    try:
        await backend.setup(config)
        engine = backend.rollout_engine()
        for step in range(config.trainer.total_steps):
            started = time.monotonic()
            groups = [
                example_group(engine, task) for task in sampler.take(config.trainer.batch_size)
            ]
            metrics.record_many(await backend.forward_backward(groups))
            backend.set_learning_rate(learning_rate(config.trainer, step))
            metrics.record_many(await backend.optim_step())
            values = metrics.flush() | {
                "step": float(step + 1),
                "time/step": time.monotonic() - started,
            }
            await asyncio.to_thread(metrics.log, step + 1, values)
        await backend.export_model(output)
    finally:
        try:
            await backend.shutdown()
        finally:
            await asyncio.to_thread(metrics.close)
    return output

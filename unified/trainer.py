"""UnifiedTrainer: the entry point — config, workflow, backend and data in; a trained run out.

It resolves what the config names, checks the backend's capabilities, creates the run directory
and hands one `TrainingLoop` (sync or async, one loop) the rest. When `fit` returns or raises,
no task of it is still running, the backend has been shut down and every metrics sink closed.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from unified.backend_calls import BackendCalls
from unified.checkpoint import RunDirectory
from unified.config import TrainerConfig, load_config
from unified.data import check_fields, load_eval_tasks, load_tasks
from unified.errors import TrainingStopped, UsageError
from unified.loop import TrainingLoop
from unified.metrics import metrics_for
from unified.model_provider import model_provider, resolve_model
from unified.protocol import BackendProtocol, check_capabilities, create_backend
from unified.rollout import WorkflowFn, required_fields, resolve_workflow
from unified.types import Task

__all__ = ["TrainResult", "TrainingStopped", "UnifiedTrainer"]


class TrainResult(BaseModel):
    """What `fit` returns: optimizer steps run, the last step's metrics, the run directory."""

    steps: int
    metrics: dict[str, float]
    run_dir: Path


class UnifiedTrainer:
    """Trains `workflow` rollouts on `backend` with the sync or async loop of `config.mode`."""

    def __init__(
        self,
        config: TrainerConfig | Mapping[str, Any] | str | Path,
        workflow: Any = None,
        backend: BackendProtocol | None = None,
        train_tasks: Iterable[Task] | None = None,
        eval_tasks: Iterable[Task] | None = None,
    ) -> None:
        self.config = load_config(config)
        model_provider(self.config.model)  # imports now; fit() builds, so a bad path fails fast
        self.workflow: WorkflowFn = resolve_workflow(
            workflow if workflow is not None else self.config.workflow
        )
        self.backend = backend if backend is not None else create_backend(self.config.backend)
        check_capabilities(self.config, self.backend)
        data = self.config.data
        self.train_tasks = list(train_tasks) if train_tasks is not None else load_tasks(data.train)
        self.eval_tasks: list[Task] = (
            list(eval_tasks)[: data.eval_limit] if eval_tasks is not None else load_eval_tasks(data)
        )
        fields = required_fields(workflow if workflow is not None else self.config.workflow)
        check_fields(self.train_tasks, fields, what="data.train")
        check_fields(self.eval_tasks, fields, what="data.eval")
        self.run = RunDirectory(self.config.run_path)

    def fit(self) -> TrainResult:
        """Train to `trainer.total_steps`; blocking wrapper around `fit_async`."""
        return asyncio.run(self.fit_async())

    async def fit_async(self) -> TrainResult:
        """Train to `trainer.total_steps` on the running event loop."""
        loop: TrainingLoop | None = None
        error: BaseException | None = None
        calls = BackendCalls(self.backend, self.config.trainer)
        fresh = not self.run.path.exists()
        try:
            self.config = await asyncio.to_thread(resolve_model, self.config)
            checkpoint = await asyncio.to_thread(
                self.run.create, self.config.to_yaml(), resume=self.config.resume
            )
            loop = TrainingLoop(
                self.config,
                self.workflow,
                self.backend,
                train_tasks=self.train_tasks,
                eval_tasks=self.eval_tasks,
                run=self.run,
                metrics=await asyncio.to_thread(metrics_for, self.config),
            )
            calls = loop.calls
            await calls.call("setup", functools.partial(self.backend.setup, self.config))
            await loop.start(checkpoint)
            await loop.run()
        except BaseExceptionGroup as group:
            error = _first_cause(group)
        except BaseException as e:
            error = e
        try:
            await calls.call("shutdown", self.backend.shutdown)
            if loop is not None:
                await asyncio.to_thread(loop.metrics.close)
        except Exception as e:
            if error is None:
                raise
            error.add_note(f"unified: the backend's shutdown also failed: {e!r}")
        if error is not None:
            if fresh and isinstance(error, UsageError) and (loop is None or loop.step == 0):
                # Bad input found before the first step: leave no half-written run behind.
                await asyncio.to_thread(shutil.rmtree, self.run.path, True)
            raise error
        assert loop is not None
        return TrainResult(steps=loop.step, metrics=loop.last_metrics, run_dir=self.run.path)


def _first_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The original exception inside (nested) task-group errors, not the group wrapper."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_cause(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group

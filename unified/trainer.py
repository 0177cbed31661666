"""UnifiedTrainer: the entry point — config, workflow, backend and data in; a trained run out.

It resolves what the config names, checks the backend's capabilities, creates the run directory
and hands one `TrainingLoop` (sync or async, one loop) the rest. When `fit` returns or raises,
no task of it is still running, the backend has been shut down and every metrics sink closed.
`fit` (not `fit_async`, whose event loop belongs to the caller) turns SIGINT and SIGTERM into an
orderly stop for as long as it runs: `TrainingInterrupted` after a final checkpoint; a second
signal exits the process at once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from unified.checkpoint import RunDirectory, TrainerState
from unified.config import TrainerConfig, check_rl_groups, load_config
from unified.data import TaskSampler, check_fields, load_eval_tasks, load_tasks
from unified.errors import TrainingInterrupted, TrainingStopped, UsageError, first_cause
from unified.loop import TrainingLoop
from unified.metrics import metrics_for
from unified.model_provider import model_provider, resolve_model
from unified.protocol import (
    BackendProtocol,
    check_capabilities,
    create_backend,
    with_partial_rollout,
)
from unified.rollout import WorkflowFn, required_fields, resolve_workflow
from unified.session import BackendSession, backend_session
from unified.threads import DaemonExecutor
from unified.types import Task

__all__ = ["TrainResult", "TrainingInterrupted", "TrainingStopped", "UnifiedTrainer"]


class TrainResult(BaseModel):
    """What `fit` returns: the run's optimizer steps, the last step's metrics, the run directory."""

    steps: int
    metrics: dict[str, float]
    run_dir: Path
    resumed_from: int | None = None
    """The checkpoint step this `fit` continued from (`resume=true`); None for a fresh run."""


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
        check_rl_groups(self.config)
        model_provider(self.config.model)  # imports now; fit() builds, so a bad path fails fast
        self.workflow: WorkflowFn = (
            resolve_workflow(workflow)
            if workflow is not None
            else resolve_workflow(self.config.workflow, self.config.workflow_args)
        )
        self.backend = backend if backend is not None else create_backend(self.config.backend)
        check_capabilities(self.config, self.backend)
        self.config = with_partial_rollout(self.backend.resolve_config(self.config), self.backend)
        data = self.config.data
        self.train_tasks = list(train_tasks) if train_tasks is not None else load_tasks(data.train)
        self.eval_tasks: list[Task] = (
            list(eval_tasks)[: data.eval_limit] if eval_tasks is not None else load_eval_tasks(data)
        )
        fields = required_fields(workflow if workflow is not None else self.config.workflow)
        check_fields(self.train_tasks, fields, what="data.train")
        check_fields(self.eval_tasks, fields, what="data.eval")
        self.run = RunDirectory(self.config.run_path)
        self._loop: TrainingLoop | None = None  # while it runs: a signal stops it
        self._built: TrainingLoop | None = None  # once built: its sinks are closed at the end
        self._stop_signal: int | None = None
        self._shutting_down = False  # the loop has ended: a signal now only cuts the shutdown

    def fit(self) -> TrainResult:
        """Train to `trainer.total_steps`; blocking wrapper around `fit_async`.

        SIGINT or SIGTERM stops the run in order (`TrainingInterrupted`, see `fit_async`); a
        second one exits the process at once with 128 + its number. Handlers are restored after.
        """

        async def fit_stopping_on_signals() -> TrainResult:
            # A blocking backend call abandoned past its deadline must not hold up the return.
            asyncio.get_running_loop().set_default_executor(DaemonExecutor())
            with _signals_call(self._on_signal):
                return await self.fit_async()

        self._stop_signal = None
        self._shutting_down = False
        return asyncio.run(fit_stopping_on_signals())

    def _same_task_order(self, state: TrainerState) -> None:
        """Refuse a checkpoint whose task order is not this run's (other tasks or seed): read
        before `config.yaml` is rewritten."""
        TaskSampler(self.train_tasks, seed=self.config.trainer.seed).load_state_dict(state.sampler)

    def _on_signal(self, signal_number: int) -> None:
        name = signal.Signals(signal_number).name
        if self._stop_signal is not None:
            print(f"unified: second {name}: exiting now", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + signal_number)
        self._stop_signal = signal_number
        grace = self.config.trainer.stop_grace_s
        if self._shutting_down:
            what = "training is over and the run is shutting down"
        else:
            what = f"the step in progress gets {grace:g} s to finish, then a checkpoint is written"
        print(
            f"unified: {name}: stopping; {what} (send {name} again to exit at once, without it)",
            file=sys.stderr,
            flush=True,
        )
        if self._loop is not None:
            self._loop.request_stop(signal_number)

    async def fit_async(self) -> TrainResult:
        """Train to `trainer.total_steps` on the running event loop.

        Raises `TrainingInterrupted` after an orderly stop (a signal during `fit`): dispatch
        stopped, the step in progress trained or abandoned, a checkpoint written.
        """
        loop: TrainingLoop | None = None
        error: BaseException | None = None
        self._built = None
        self.run.created = False  # of this `fit`: a failure before it makes one removes nothing
        try:
            describe = "before training: no group dispatched yet"
            async with backend_session(self.backend, self.config, describe=describe) as s:
                try:
                    loop = await self._train(s)
                finally:  # the backend's shutdown follows: a signal now only cuts it short
                    self._loop = None
                    self._shutting_down = True
                if loop.stop_signal is not None and not loop.finished:
                    raise await asyncio.to_thread(_interrupted, loop, self.run)
        except BaseExceptionGroup as group:
            error = first_cause(group)
        except BaseException as e:
            error = e
        loop = loop or self._built
        if loop is not None:  # after the backend's shutdown, whatever it did: metrics all out
            try:
                await loop.close()
            except Exception as e:
                error = _also(error, e, "closing the metrics")
        if error is not None:
            if self.run.created and (loop is None or loop.step == 0):
                # Bad input, a stop or a failure before the first step: a run that trained
                # nothing leaves no directory behind to block the next try under its name.
                await asyncio.to_thread(shutil.rmtree, self.run.path, True)
            elif (
                loop is not None
                and loop.step >= 1
                and isinstance(error, Exception)
                and not isinstance(error, TrainingInterrupted | UsageError)
            ):  # a failure in training, after a step: this run's newest checkpoint holds it
                checkpoint = await asyncio.to_thread(self.run.latest_checkpoint)
                if checkpoint is not None:  # the failure did not touch it: say where to go on
                    error.add_note(f"checkpoint {checkpoint}; continue with resume=true")
            raise error
        assert loop is not None
        resumed = self.run.resumed_step
        return TrainResult(
            steps=loop.step,
            metrics=loop.last_metrics,
            run_dir=self.run.path,
            resumed_from=resumed if resumed is not None and resumed >= 0 else None,
        )

    async def _train(self, session: BackendSession) -> TrainingLoop:
        """Resolve the model, make the run directory, build the loop, set the backend up, and
        train; the loop is kept in `_built` as soon as it exists, for closing its sinks."""
        self.config = await asyncio.to_thread(resolve_model, self.config)
        checkpoint = await asyncio.to_thread(
            self.run.create,
            self.config.to_yaml(),
            resume=self.config.resume,
            check_state=self._same_task_order,
        )
        loop = self._loop = self._built = await self._new_loop(session)
        if self._stop_signal is not None:
            loop.request_stop(self._stop_signal)
        await session.setup(self.config, loads_checkpoint=checkpoint is not None)
        await loop.start(checkpoint)
        await loop.run()
        return loop

    async def _new_loop(self, session: BackendSession) -> TrainingLoop:
        """The run's loop, writing to the metrics sinks of the config (closed if it fails)."""
        metrics = await asyncio.to_thread(metrics_for, self.config, self.run.resumed_step)
        try:
            loop = TrainingLoop(
                self.config,
                self.workflow,
                session,
                train_tasks=self.train_tasks,
                eval_tasks=self.eval_tasks,
                run=self.run,
                metrics=metrics,
            )
        except BaseException:
            await asyncio.to_thread(metrics.close)  # the loop would have closed its sinks
            raise
        session.describe = loop.describe
        return loop


def _also(error: BaseException | None, failure: Exception, what: str) -> BaseException:
    """`failure` as the run's error, or a note on the error already ending the run."""
    if error is None:
        return failure
    error.add_note(f"unified: {what} also failed: {failure!r}")
    return error


def _interrupted(loop: TrainingLoop, run: RunDirectory) -> TrainingInterrupted:
    assert loop.stop_signal is not None
    name = signal.Signals(loop.stop_signal).name
    checkpoint = run.latest_checkpoint()
    if loop.step == 0 and run.created:
        outcome = "nothing was trained, so the run directory is removed: start it again"
    else:
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step trained)"
        outcome = f"{saved}; continue with resume=true"
    return TrainingInterrupted(
        f"{name}: training stopped after step {loop.step}; {outcome}",
        signal_number=loop.stop_signal,
    )


@contextmanager
def _signals_call(handler: Callable[[int], None]) -> Iterator[None]:
    """Run `handler(signal_number)` on the running loop for SIGINT and SIGTERM, then restore the
    handlers found. Off the main thread (or without loop signal support) it installs nothing."""
    loop = asyncio.get_running_loop()
    installed: list[tuple[signal.Signals, Any]] = []
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signal_number)
        try:
            loop.add_signal_handler(signal_number, handler, signal_number)
        except (ValueError, RuntimeError, NotImplementedError):
            continue
        installed.append((signal_number, previous))
    try:
        yield
    finally:
        for signal_number, previous in installed:
            loop.remove_signal_handler(signal_number)
            if previous is not None:  # None: not set from Python; the default is back already
                signal.signal(signal_number, previous)

"""UnifiedTrainer: one trainer, two loops (sync and fully async), any backend.

Sync: per step, generate `batch_size` groups (refilling filtered or failed ones), train, sync.
Async: a producer dispatches groups under the coordinator's admission control while the consumer
trains on ready groups as they come. Both loops share the group runner, the train step and the
weight sync, so `max_staleness: 0, sync_every: 1` async trains exactly what sync trains.
Every task the trainer starts lives in an `asyncio.TaskGroup`; when `fit` returns or raises,
none is still running and the backend has been shut down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from unified.buffer import GroupTicket, Outcome, TrajectoryGroupBuffer
from unified.checkpoint import LedgerEntry, RunDirectory, TrainerState
from unified.config import TrainerConfig, load_config
from unified.coordinator import SyncCoordinator
from unified.data import TaskSampler, load_eval_tasks, load_tasks
from unified.errors import UnifiedError
from unified.evaluation import evaluate
from unified.metrics import MetricsAggregator, metrics_for
from unified.protocol import BackendProtocol, check_capabilities, create_backend
from unified.rollout import SamplingEngine, WorkflowFn, resolve_workflow, run_episode
from unified.schedule import learning_rate
from unified.types import Episode, Task, TrajectoryGroup

__all__ = ["TrainResult", "TrainingStopped", "UnifiedTrainer"]

Item = tuple[GroupTicket, TrajectoryGroup]


class TrainingStopped(UnifiedError):
    """Training cannot make progress (e.g. every group is filtered); the message says why."""


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
        self.run = RunDirectory(self.config.run_path)

    def fit(self) -> TrainResult:
        """Train to `trainer.total_steps`; blocking wrapper around `fit_async`."""
        return asyncio.run(self.fit_async())

    async def fit_async(self) -> TrainResult:
        """Train to `trainer.total_steps` on the running event loop."""
        loop: _Loop | None = None
        error: BaseException | None = None
        try:
            checkpoint = await asyncio.to_thread(
                self.run.create, self.config.to_yaml(), resume=self.config.resume
            )
            loop = _Loop(self, await asyncio.to_thread(metrics_for, self.config))
            await self.backend.setup(self.config)
            await loop.start(checkpoint)
            await (loop.run_sync() if self.config.mode == "sync" else loop.run_async())
        except BaseExceptionGroup as group:
            error = _first_cause(group)
        except BaseException as e:
            error = e
        try:
            await self.backend.shutdown()
            if loop is not None:
                await asyncio.to_thread(loop.metrics.close)
        except Exception as e:
            if error is None:
                raise
            error.add_note(f"unified: the backend's shutdown also failed: {e!r}")
        if error is not None:
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


def _entry(
    ticket: GroupTicket,
    outcome: Outcome,
    step: int,
    policy_version: int,
    trainer_version: int,
    reason: str = "",
) -> LedgerEntry:
    """The ledger line of a group that ended in (1-based) optimizer step `step`."""
    return LedgerEntry(
        group_id=ticket.group_id,
        task_id=ticket.task_id,
        outcome=outcome,
        step=step,
        policy_version=policy_version,
        trainer_version=trainer_version,
        reason=reason,
    )


class _Loop:
    """The state of one `fit` call: coordinator, buffer, sampler, counters and both loops."""

    def __init__(self, trainer: UnifiedTrainer, metrics: MetricsAggregator) -> None:
        self.trainer = trainer
        self.config = cfg = trainer.config
        self.t, self.a = cfg.trainer, cfg.async_
        self.backend = trainer.backend
        self.run = trainer.run
        self.metrics = metrics
        self.coordinator = SyncCoordinator.for_config(cfg)
        self.buffer = TrajectoryGroupBuffer(
            group_size=self.t.group_size,
            advantage=self.t.advantage,
            filter_groups=self.t.filter_groups,
            coordinator=self.coordinator,
            metrics=self.metrics,
        )
        self.sampler = TaskSampler(trainer.train_tasks, seed=self.t.seed)
        self.step = 0
        self.next_seq = 0
        self.redispatch: list[Task] = []
        self.alive_tasks: dict[str, Task] = {}
        self.episodes_done = 0
        self.episodes_failed = 0
        self.tokens = 0
        self.last_metrics: dict[str, float] = {}
        self._time_up = False
        self._step_started = self._started = time.monotonic()

    # -- set-up and resume ----------------------------------------------------------------

    async def start(self, checkpoint: Path | None) -> None:
        """Restore `checkpoint` if given, then evaluate before training."""
        if checkpoint is not None:
            state = await RunDirectory.load_checkpoint(checkpoint, self.backend.load_checkpoint)
            self.step, self.next_seq = state.step, state.next_seq
            self.sampler.load_state_dict(state.sampler)
            by_id = {task.id: task for task in self.trainer.train_tasks}
            self.redispatch = [by_id[i] for i in state.redispatch if i in by_id]
            # The backend restored its sampler (weights and version) itself; reopen the window
            # at the point of the sync cycle the checkpoint was taken.
            taken = (state.step % self.a.sync_every) * self.t.batch_size
            self.coordinator.restore(state.version, taken_since_sync=taken)
        if self.step == 0 and self.t.eval_before_train and self.trainer.eval_tasks:
            await self._log(await self._evaluate())
        self._set_wanted(0)
        self._step_started = self._started = time.monotonic()
        self.coordinator.take_idle_seconds()

    # -- the two loops ------------------------------------------------------------------------

    async def run_sync(self) -> None:
        """Generate a full batch, then train on it; repeat."""
        while not self.finished:
            started = time.monotonic()
            items: list[Item] = []
            while len(items) < self.t.batch_size:
                async with asyncio.TaskGroup() as tg:
                    for _ in range(self.t.batch_size - len(items)):
                        version = await self.coordinator.admit()
                        tg.create_task(self._run_group(version))
                items += self._pop_all_ready()
                await self._write_ended()
            for ticket, _ in items:
                self.coordinator.take(ticket.version)
            generate_s = time.monotonic() - started
            forward_s = await self._forward(items)
            await self._finish_step(items, forward_s=forward_s, wait_s=generate_s)

    async def run_async(self) -> None:
        """Dispatch continuously; train on ready groups as they arrive; sync every K steps."""
        async with asyncio.TaskGroup() as tg:
            producer = tg.create_task(self._produce())
            try:
                while not self.finished:
                    items: list[Item] = []
                    wait_s = forward_s = 0.0
                    micro = self.t.micro_batch_size or self.t.batch_size
                    while len(items) < self.t.batch_size:
                        started = time.monotonic()
                        items.append(await self._take_ready())
                        wait_s += time.monotonic() - started
                        self._set_wanted(len(items))
                        await self._write_ended()
                        if len(items) % micro == 0 or len(items) == self.t.batch_size:
                            # Streamed accumulation: train this chunk while later groups generate.
                            forward_s += await self._forward(
                                items[(len(items) - 1) // micro * micro :]
                            )
                    await self._finish_step(items, forward_s=forward_s, wait_s=wait_s)
            finally:
                producer.cancel()

    async def _produce(self) -> None:
        async with asyncio.TaskGroup() as groups:
            while True:
                version = await self.coordinator.admit()
                groups.create_task(self._run_group(version))

    async def _take_ready(self) -> Item:
        found: list[Item] = []

        def ready() -> bool:
            item = self.buffer.pop_ready(self.coordinator.may_take)
            if item is not None:
                found.append(item)
            return item is not None

        await self.coordinator.wait_until(ready, "a trainable group")
        ticket, group = found[0]
        self.coordinator.take(ticket.version)
        return ticket, group

    def _pop_all_ready(self) -> list[Item]:
        items = []
        while (item := self.buffer.pop_ready(lambda _version: True)) is not None:
            items.append(item)
        return items

    def _set_wanted(self, taken_this_step: int) -> None:
        remaining = (self.t.total_steps - self.step) * self.t.batch_size - taken_this_step
        self.coordinator.set_wanted(max(0, remaining))

    # -- one group ----------------------------------------------------------------------------

    async def _run_group(self, version: int) -> None:
        task = self.redispatch.pop(0) if self.redispatch else self.sampler.next()
        seq = self.next_seq
        self.next_seq += 1
        ticket = GroupTicket(version, seq, f"g{seq:06d}-{task.id}", task.id)
        self.alive_tasks[ticket.group_id] = task
        self.buffer.open(ticket)
        try:
            async with asyncio.TaskGroup() as tg:
                for index in range(self.t.group_size):
                    tg.create_task(self._run_rollout(ticket, task, index))
        except BaseException:
            self.buffer.abandon(ticket.group_id)
            raise

    async def _run_rollout(self, ticket: GroupTicket, task: Task, index: int) -> None:
        seed = ((self.t.seed * 1_000_003 + ticket.seq) * 1_009 + index) % 2**31
        async with self.coordinator.workflow_slot():
            engine = SamplingEngine(self.backend.rollout_engine(), self.config.sampling.train, seed)
            episode, error = await run_episode(
                self.trainer.workflow,
                task,
                engine,
                rollout_index=index,
                version=ticket.version,
                timeout_s=self.t.workflow_timeout,
            )
        self.tokens += engine.completion_tokens
        self._count_episode(episode, error)
        self.buffer.add_episode(ticket.group_id, episode)
        if self.buffer.unproductive_in_a_row >= self.t.max_filtered_in_a_row:
            raise TrainingStopped(
                f"the last {self.buffer.unproductive_in_a_row} groups all ended filtered (equal "
                f"rewards) or failed (last one {self.buffer.last_unproductive_reason}), after "
                f"{self.step} trained steps: the rewards give no learning signal for this policy; "
                "check the workflow's reward, or set trainer.filter_groups=false"
            )

    def _count_episode(self, episode: Episode, error: BaseException | None) -> None:
        self.episodes_done += 1
        if episode.status == "ok" or error is None:
            return
        self.episodes_failed += 1
        key = "episodes/timeouts" if episode.status == "timeout" else "episodes/errors"
        self.metrics.record(key, 1.0)
        floor = self.t.batch_size * self.t.group_size
        if self.episodes_failed > self.t.max_error_rate * max(self.episodes_done, floor):
            error.add_note(
                f"unified: {self.episodes_failed} of {self.episodes_done} episodes failed, above "
                f"trainer.max_error_rate={self.t.max_error_rate:g}; training stopped"
            )
            raise error

    # -- one optimizer step -------------------------------------------------------------------

    async def _forward(self, items: list[Item]) -> float:
        """`forward_backward` on `items` in dispatch order, `micro_batch_size` groups a call."""
        started = time.monotonic()
        ordered = sorted(items, key=lambda item: item[0])
        chunk = self.t.micro_batch_size or self.t.batch_size
        for start in range(0, len(ordered), chunk):
            groups = [group for _, group in ordered[start : start + chunk]]
            self.metrics.record_many(await self.backend.forward_backward(groups))
        return time.monotonic() - started

    async def _finish_step(self, items: list[Item], *, forward_s: float, wait_s: float) -> None:
        """Optimizer step, ledger, weight sync every `sync_every` steps, metrics, eval, save."""
        items.sort(key=lambda item: item[0])
        version = self.coordinator.version
        train_started = time.monotonic()
        self.backend.set_learning_rate(learning_rate(self.t, self.step))
        self.metrics.record_many(await self.backend.optim_step())
        train_s = forward_s + time.monotonic() - train_started
        self.step += 1
        for ticket, group in items:
            self.alive_tasks.pop(ticket.group_id, None)
            self._record_rewards(e.reward for e in group.episodes)
        trained = [_entry(t, "trained", self.step, g.policy_version, version) for t, g in items]
        await asyncio.to_thread(self.run.append_ledger, trained)
        sync_s = 0.0
        if self.step % self.a.sync_every == 0:
            sync_s = await self._sync_weights()
        self._set_wanted(0)
        staleness = [version - group.policy_version for _, group in items]
        step_s = time.monotonic() - self._step_started
        budget = self.t.max_time_s
        # Decided once per step, so the final eval and save see the same answer as the loop.
        self._time_up = budget is not None and time.monotonic() - self._started >= budget
        self.metrics.record_many(
            {
                "groups/trained": float(len(items)),
                # Counters appear every step, zero or not, so curves have no gaps.
                "groups/filtered": 0.0,
                "episodes/errors": 0.0,
                "episodes/timeouts": 0.0,
                "staleness/mean": sum(staleness) / len(staleness),
                "staleness/max": float(max(staleness)),
                "optim/lr": learning_rate(self.t, self.step - 1),
            }
        )
        timing = {
            "step": float(self.step),
            "policy/version": float(self.coordinator.version),
            "time/step": step_s,
            "time/generate": wait_s,
            "time/train": train_s,
            "time/sync": sync_s,
            "throughput/tokens_per_s": self.tokens / step_s if step_s > 0 else 0.0,
            "trainer/idle_ratio": wait_s / step_s if step_s > 0 else 0.0,
            "rollout/idle_ratio": self.coordinator.take_idle_seconds() / step_s
            if step_s > 0
            else 0.0,
        }
        self.tokens = 0
        metrics = {**self.metrics.flush(), **timing}
        if self.trainer.eval_tasks and self._eval_due():
            metrics.update(await self._evaluate())
        await self._log(metrics)
        if self.t.save_every and (self.step % self.t.save_every == 0 or self.finished):
            await self._save()
        # Evaluation, logging and saving belong to no step's timing.
        self._step_started = time.monotonic()

    @property
    def finished(self) -> bool:
        """All `total_steps` done, or the `max_time_s` budget spent by the last step."""
        return self.step >= self.t.total_steps or self._time_up

    def _eval_due(self) -> bool:
        every = self.t.eval_every
        return every > 0 and (self.step % every == 0 or self.finished)

    async def _sync_weights(self) -> float:
        started = time.monotonic()
        drain = self.config.mode == "async" and not self.a.partial_rollout
        if drain:
            self.coordinator.pause()
            await self.coordinator.drain()
        try:
            version = self.coordinator.version + 1
            await self.backend.on_policy_updated(version)
            self.coordinator.synced(version)
        finally:
            if drain:
                self.coordinator.resume()
        return time.monotonic() - started

    def _record_rewards(self, rewards: Iterable[float]) -> None:
        """Rewards of groups that ended this step (trained or not): `reward/mean`, `/std`."""
        for reward in rewards:
            self.metrics.record("reward/mean", reward)
            self.metrics.record("reward/std", reward)

    async def _write_ended(self) -> None:
        ended_groups = self.buffer.pop_ended()
        version = self.coordinator.version
        entries = [
            _entry(e.ticket, e.outcome, self.step + 1, e.policy_version, version, e.reason)
            for e in ended_groups
        ]
        for entry in entries:
            self.alive_tasks.pop(entry.group_id, None)
        for ended in ended_groups:
            self._record_rewards(ended.rewards)
        await asyncio.to_thread(self.run.append_ledger, entries)

    async def _evaluate(self) -> dict[str, float]:
        return await evaluate(
            self.trainer.workflow,
            self.backend.rollout_engine(),
            self.trainer.eval_tasks,
            self.config.sampling.eval,
            seed=self.t.seed,
            version=self.coordinator.version,
            timeout_s=self.t.workflow_timeout,
            slot=self.coordinator.workflow_slot,
        )

    async def _log(self, metrics: dict[str, float]) -> None:
        self.last_metrics = metrics
        await asyncio.to_thread(self.metrics.log, self.step, metrics)

    async def _save(self) -> None:
        state = TrainerState(
            step=self.step,
            version=self.coordinator.version,
            next_seq=self.next_seq,
            sampler=self.sampler.state_dict(),
            redispatch=[task.id for task in self.alive_tasks.values()]
            + [task.id for task in self.redispatch],
        )
        await self.run.save_checkpoint(state, self.backend.save_checkpoint)

"""TrainingLoop: one `fit`, read top to bottom — dispatch groups, train ready ones, sync weights.

A dispatcher admits groups whenever the buffer allows and runs each group's `group_size`
workflows; the trainer takes ready groups oldest first, calls `forward_backward` on them (in
async mode streamed, `micro_batch_size` groups at a time), `optim_step`, and when due
`on_policy_updated`: its only wait at a sync, through which workflows keep running. Sync mode is
this loop at staleness 0 with a window of one step that trains only a whole batch. Every task
lives in a `TaskGroup` owned by `run`. One owner per fact: the `TrajectoryGroupBuffer` (with its
`SyncCoordinator`) every group and the version; the `StepRecorder` counters, timing and metrics
lines; `GracefulStop` a stop request; the loop only the order of things.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from pathlib import Path

from unified.checkpoint import RunDirectory
from unified.config import TrainerConfig
from unified.errors import TrainingStopped
from unified.evaluation import evaluate_for
from unified.executors import fewer_young_collections, rollout_executor
from unified.groups import GroupTicket, TrajectoryGroupBuffer
from unified.metrics import MetricsAggregator
from unified.recorder import StepRecorder
from unified.rollout import EngineClock, WorkflowFn, WorkflowSlots, episode_seed
from unified.schedule import EntropyControl, learning_rate
from unified.session import BackendSession
from unified.stopping import GracefulStop, StepAbandoned, no_signal_message
from unified.types import Task, TrajectoryGroup

__all__ = ["TrainingLoop"]

Item = tuple[GroupTicket, TrajectoryGroup]


class TrainingLoop:
    """The state of one `fit` call and the loop that drives it; `UnifiedTrainer` builds it."""

    def __init__(
        self,
        config: TrainerConfig,
        workflow: WorkflowFn,
        session: BackendSession,
        *,
        train_tasks: Sequence[Task],
        eval_tasks: Sequence[Task],
        run: RunDirectory,
        metrics: MetricsAggregator,
    ) -> None:
        self.config = config
        self.workflow = workflow
        self.session = session
        self.backend = backend = session.backend
        self.train_tasks = train_tasks
        self.eval_tasks = eval_tasks
        self.run_dir = run
        self.engine_clock = EngineClock()
        self.rollouts = rollout_executor(config, workflow, backend, self.engine_clock)  # may refuse
        self.groups = TrajectoryGroupBuffer.for_config(config, train_tasks, run.append_ledger)
        self.recorder = StepRecorder(config, metrics)  # starts the metrics writer thread
        self.slots = WorkflowSlots.for_config(config)
        self.calls = session.calls
        self.step = 0
        settings = config.trainer
        # Async mode trains a micro-batch as soon as it is ready; sync mode only a whole batch.
        micro = settings.micro_batch_size if config.mode == "async" else None
        self._train_every: int = micro or settings.batch_size
        self._per_call = settings.micro_batch_size or settings.batch_size  # groups a call
        self._time_up = False
        self.stop = GracefulStop(settings.stop_grace_s)
        self._saved_step = 0  # the step of the newest checkpoint; step 0 needs none
        self.entropy = EntropyControl(settings)

    @property
    def stop_signal(self) -> int | None:
        """The signal number `request_stop` was called with, once it was."""
        return self.stop.signal

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last line logged (a step's, or the evaluation before training)."""
        return self.recorder.last_metrics

    # -- start and run ----------------------------------------------------------------------------

    async def start(self, checkpoint: Path | None) -> None:
        """Restore `checkpoint` if given, then evaluate before training."""
        settings = self.config.trainer
        if checkpoint is not None:
            # The backend restores its sampler (weights and version) itself.
            state = await RunDirectory.load_checkpoint(checkpoint, self.session.load_checkpoint)
            self.step = self._saved_step = state.step
            self.groups.restore_state(state, self.train_tasks)
            if self.entropy.adaptive and state.entropy_coef is not None:
                self.entropy.coef = state.entropy_coef
        if self.entropy.adaptive:
            self.backend.set_entropy_coef(self.entropy.coef)
        stopping = self.stop_signal is not None
        if self.step == 0 and settings.eval_before_train and self.eval_tasks and not stopping:
            await self.recorder.log(self.step, await self._evaluate())
        self._want_groups()
        self.recorder.start_clocks()
        self.groups.take_idle_seconds()
        self.engine_clock.take_idle_seconds()

    async def run(self) -> None:
        """Train until `total_steps` (or `max_time_s`, or a stop), the dispatcher alongside;
        after a stop, save the last trained step unless a checkpoint holds it."""
        with fewer_young_collections():
            async with self.rollouts.serving(), asyncio.TaskGroup() as tg:
                dispatcher = tg.create_task(self._dispatch())
                try:
                    while not self.finished and self.step < self.stop.last_step:
                        await self._train_step()
                except StepAbandoned:
                    pass
                finally:
                    dispatcher.cancel()
        if self.stop_signal is not None and self._saved_step != self.step:
            await self._save()

    def request_stop(self, signal_number: int) -> None:
        """Dispatch nothing more; the step in progress (between steps: the next one) gets
        `stop_grace_s` to get its groups from those dispatched, and is the last step trained.

        Call it on the event loop running `run` (a signal handler added with
        `loop.add_signal_handler` runs there); a second call changes nothing.
        """
        if self.stop.request(signal_number, self.step):
            self._want_groups()

    @property
    def finished(self) -> bool:
        """All `total_steps` done, or the `max_time_s` budget spent by the last step."""
        return self.step >= self.config.trainer.total_steps or self._time_up

    async def close(self) -> None:
        """Finish the metrics writes, then close every sink."""
        await self.recorder.close(self.step)

    # -- generation -------------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Admit groups whenever the buffer allows; their workflows run as tasks here. While a
        whole group would find free workflow slots, it may admit beyond the staleness bound."""
        group_size = self.config.trainer.group_size
        can_admit = functools.partial(self.groups.can_admit, self.config.async_.max_concurrency)
        async with asyncio.TaskGroup() as rollouts:
            while True:
                # No stall clock: only the trainer frees slots, and its own waits have deadlines.
                await self.groups.wait_until(can_admit, "an admission slot", stall_clock=False)
                ticket, task = self.groups.dispatch()
                started = [
                    rollouts.create_task(self._rollout(ticket, task, index))
                    for index in range(group_size)
                ]
                self.groups.running(ticket, started)

    async def _rollout(self, ticket: GroupTicket, task: Task, index: int) -> None:
        settings = self.config.trainer
        seed = episode_seed(settings.seed, ticket.seq, index)
        async with self.slots:
            episode, error, tokens = await self.rollouts.run(
                task, index, version=ticket.version, seed=seed
            )
        if not self.groups.generating(ticket):  # requeued, and its workflow ignored the cancel
            return
        self.recorder.episode(episode, error, tokens)
        self.groups.add_episode(ticket, episode)
        if self.groups.unproductive_in_a_row >= settings.max_filtered_in_a_row:
            entropy = self.last_metrics.get("train/entropy")
            raise TrainingStopped(no_signal_message(self.groups, self.step, entropy))

    # -- one optimizer step -----------------------------------------------------------------------

    async def _train_step(self) -> None:
        """Take `batch_size` ready groups (training them as they come in async mode), then step."""
        batch = self.config.trainer.batch_size
        items: list[Item] = []
        wait_s = forward_s = 0.0
        while len(items) < batch:
            started = time.monotonic()
            items.append(await self.stop.next_ready(self.groups, batch - len(items)))
            wait_s += time.monotonic() - started
            self._want_groups(taken=len(items))
            self.recorder.ended(await self.groups.write_ended(self.step + 1))
            if len(items) % self._train_every == 0 or len(items) == batch:
                first = (len(items) - 1) // self._train_every * self._train_every
                started = time.monotonic()  # forward_backward in dispatch order
                ready = [group for _, group in sorted(items[first:], key=lambda item: item[0])]
                for reply in await self.calls.forward_backward(ready, self._per_call):
                    self.recorder.forward_reply(reply)
                forward_s += time.monotonic() - started
        await self._finish_step(items, forward_s=forward_s, wait_s=wait_s)

    async def _finish_step(self, items: list[Item], *, forward_s: float, wait_s: float) -> None:
        """Optimizer step, ledger, weight sync when due, metrics, eval, save."""
        settings = self.config.trainer
        items.sort(key=lambda item: item[0])
        trained_at = self.groups.version
        started = time.monotonic()
        self.backend.set_learning_rate(learning_rate(settings, self.step))
        reply = await self.calls.metrics("optim_step", self.backend.optim_step)
        reason = self.recorder.optim_reply(reply)
        train_s = forward_s + time.monotonic() - started
        self.step += 1
        await self.groups.write_trained(items, self.step, trained_at, reason=reason)
        sync_s = 0.0
        if (version := self.groups.after_step(self.step)) is not None:
            synced = time.monotonic()
            await self.calls.on_policy_updated(version)  # running workflows carry on
            self.groups.open_window(version)
            sync_s = time.monotonic() - synced
        if self.step >= settings.total_steps:
            self.groups.end_run()
        self.recorder.ended(await self.groups.write_ended(self.step))  # the requeued, if any
        self._want_groups()
        # Decided once per step, so the final eval and save see the same answer as the loop.
        self._time_up = self.recorder.time_up()
        metrics = self.recorder.step_metrics(
            self.step,
            items,
            self.groups,
            trained_at,
            wait_s=wait_s,
            train_s=train_s,
            sync_s=sync_s,
            engine_idle_s=self.engine_clock.take_idle_seconds(),
        )
        if self.entropy.adaptive:  # the coefficient this step trained with, then the next one
            metrics["train/entropy_coef"] = self.entropy.coef
            self.backend.set_entropy_coef(self.entropy.update(metrics.get("train/entropy")))
        every = settings.eval_every
        if self.eval_tasks and every > 0 and (self.step % every == 0 or self.finished):
            metrics.update(await self._evaluate())
        await self.recorder.log(self.step, metrics)
        periodic = settings.save_every and self.step % settings.save_every == 0
        if periodic or (self.finished and settings.save_final):
            await self._save()
        self.recorder.step_done()

    # -- evaluation and checkpoints ---------------------------------------------------------------

    def _want_groups(self, taken: int = 0) -> None:
        """Dispatch only what the steps left need (`taken`: this step's); after a stop, none."""
        steps = self.config.trainer.total_steps - self.step if self.stop_signal is None else 0
        self.groups.want_steps(steps, taken=taken)

    async def _evaluate(self) -> dict[str, float]:
        sampler, version = self.backend.token_sampler(), self.groups.version
        return await evaluate_for(
            self.config, self.workflow, sampler, self.eval_tasks, version=version, slots=self.slots
        )

    async def _save(self) -> None:
        await self.recorder.drain(self.step)  # the metrics of every step the checkpoint holds
        state = self.groups.checkpoint_state(self.step, self.run_dir.ledger_lines)
        if self.entropy.adaptive:
            state.entropy_coef = self.entropy.coef
        await self.run_dir.save_checkpoint(state, self.session.save_checkpoint)
        self._saved_step = self.step

    def describe(self) -> str:
        """Who is where, for the error of a wait that passed its deadline."""
        return f"step={self.step}, {self.groups.describe()}, workflows running={self.slots.running}"

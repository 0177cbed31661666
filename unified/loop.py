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
from unified.evaluation import evaluate_for, is_correct
from unified.executors import fewer_young_collections, rollout_executor
from unified.groups import EndedGroup, GroupTicket, TrajectoryGroupBuffer
from unified.metrics import MetricsAggregator
from unified.recorder import StepRecorder
from unified.records import RecordWriter, StepTimeline
from unified.rollout import EngineClock, WorkflowFn, WorkflowSlots, episode_seed
from unified.schedule import EntropyControl, learning_rate
from unified.session import BackendSession
from unified.stopping import GracefulStop, StepAbandoned, no_signal_message
from unified.types import Episode, Task, TrajectoryGroup

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
        logging = config.logging
        self.records = RecordWriter(  # starts the records writer thread
            run.path,
            every=logging.record_every,
            eval_episodes=logging.record_eval,
            max_mb=logging.records_max_mb,
            lines=run.records_lines,
            enabled=logging.records,
        )
        self.timeline = StepTimeline()
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
        self.records.tokenizer = self.backend.token_sampler().tokenizer
        self.records.run_started(self.step, self.config.mode, self.config.backend)
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
        """Finish the metrics and records writes, then close every sink."""
        try:
            await self.recorder.close(self.step)
        finally:
            await self.records.close(self.config.trainer.stall_timeout_s)

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
        timeline = self.timeline
        while len(items) < batch:
            with timeline.span("wait"):
                items.append(await self.stop.next_ready(self.groups, batch - len(items)))
            self._want_groups(taken=len(items))
            await self._write_ended(self.step + 1)
            if len(items) % self._train_every == 0 or len(items) == batch:
                first = (len(items) - 1) // self._train_every * self._train_every
                # forward_backward in dispatch order
                ready = [group for _, group in sorted(items[first:], key=lambda item: item[0])]
                with timeline.span("forward"):
                    for reply in await self.calls.forward_backward(ready, self._per_call):
                        self.recorder.forward_reply(reply)
        await self._finish_step(items)

    async def _finish_step(self, items: list[Item]) -> None:
        """Optimizer step, ledger, weight sync when due, metrics, eval, save."""
        settings = self.config.trainer
        timeline = self.timeline
        items.sort(key=lambda item: item[0])
        trained_at = self.groups.version
        with timeline.span("optim"):
            self.backend.set_learning_rate(learning_rate(settings, self.step))
            reply = await self.calls.metrics("optim_step", self.backend.optim_step)
            reason = self.recorder.optim_reply(reply)
        self.step += 1
        await self.groups.write_trained(items, self.step, trained_at, reason=reason)
        self._record_trained(items, trained_at)
        if (version := self.groups.after_step(self.step)) is not None:
            with timeline.span("sync"):
                await self.calls.on_policy_updated(version)  # running workflows carry on
                self.groups.open_window(version)
        if self.step >= settings.total_steps:
            self.groups.end_run()
        await self._write_ended(self.step)  # the requeued, if any
        self._want_groups()
        # Decided once per step, so the final eval and save see the same answer as the loop.
        self._time_up = self.recorder.time_up()
        metrics = self.recorder.step_metrics(
            self.step,
            items,
            self.groups,
            trained_at,
            wait_s=timeline.seconds("wait"),
            train_s=timeline.seconds("forward") + timeline.seconds("optim"),
            sync_s=timeline.seconds("sync"),
            engine_idle_s=self.engine_clock.take_idle_seconds(),
        )
        self.records.step(self.step, timeline.take(), trained_at=trained_at, synced_to=version)
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
        episodes: list[tuple[Task, Episode]] | None = [] if self.records.eval_episodes else None
        started = time.time()
        metrics = await evaluate_for(
            self.config,
            self.workflow,
            sampler,
            self.eval_tasks,
            version=version,
            slots=self.slots,
            keep=episodes,
        )
        scored = [(task, e, is_correct(e)) for task, e in episodes or ()]
        self.records.evaluated(
            self.step, started, time.time(), metrics["eval/accuracy"], scored, version
        )
        return metrics

    async def _write_ended(self, step: int) -> None:
        """The ledger lines (and records) of the groups that ended untrained, in `step`."""
        ended: list[EndedGroup] = await self.groups.write_ended(step)
        self.recorder.ended(ended)
        version = self.groups.version
        for group in ended:
            if self.records.records_group(group.ticket.seq):
                self.records.group(step, group.ticket, group.outcome, version, group.episodes)

    def _record_trained(self, items: Sequence[Item], trained_at: int) -> None:
        for ticket, group in items:
            if self.records.records_group(ticket.seq):
                advantages = {
                    e.rollout_index: a
                    for e, a in zip(group.episodes, group.advantages, strict=True)
                }
                self.records.group(
                    self.step, ticket, "trained", trained_at, ticket.episodes, advantages
                )

    async def _save(self) -> None:
        timeout_s = self.config.trainer.stall_timeout_s
        await self.recorder.drain(self.step)  # the metrics of every step the checkpoint holds
        records_lines = await self.records.drain(timeout_s)  # and its records
        state = self.groups.checkpoint_state(self.step, self.run_dir.ledger_lines)
        state.records_lines = records_lines
        if self.entropy.adaptive:
            state.entropy_coef = self.entropy.coef
        started = time.time()
        await self.run_dir.save_checkpoint(state, self.session.save_checkpoint)
        self.records.saved(self.step, started, time.time())
        self._saved_step = self.step

    def describe(self) -> str:
        """Who is where, for the error of a wait that passed its deadline."""
        return f"step={self.step}, {self.groups.describe()}, workflows running={self.slots.running}"

"""TrainingLoop: one `fit`, read top to bottom — dispatch groups, train ready ones, sync weights.

Both modes are this one loop. A dispatcher admits groups whenever the coordinator allows and runs
each group's `group_size` workflows; the trainer takes ready groups oldest first, calls
`forward_backward` on them (in async mode streamed, `micro_batch_size` groups at a time, while
later groups still generate), `optim_step`, and every `sync_every` steps `on_policy_updated`.
That call is the trainer's only wait at a sync: workflows keep running through it, and what
happens to a model request running at that moment is the backend's concern. Sync mode is the
same loop at staleness 0 with an admission window of one step that trains only a whole batch,
so generation and training alternate. Every task lives in a `TaskGroup` owned by `run`.

`request_stop` (SIGINT/SIGTERM in `UnifiedTrainer.fit`) stops dispatch at once; the step in
progress (between steps: the next one, whose groups may all be out already) still trains if its
groups are ready within `trainer.stop_grace_s`, else it is abandoned without an optimizer step.
Then a checkpoint holds everything not trained, to dispatch again. Metrics lines go to their
sinks on a thread of their own, off the training path.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from unified.backend_calls import BackendCalls, finite
from unified.checkpoint import RunDirectory, TrainerState
from unified.config import TrainerConfig
from unified.coordinator import SyncCoordinator
from unified.data import TaskSampler
from unified.errors import StallError, TrainingStopped
from unified.evaluation import episode_tool_calls, evaluate
from unified.executors import rollout_executor
from unified.groups import EndedGroup, GroupTicket, TrajectoryGroupBuffer
from unified.metrics import MetricsAggregator
from unified.protocol import BackendProtocol
from unified.rollout import WorkflowFn, WorkflowSlots
from unified.schedule import learning_rate
from unified.threads import DaemonWorker
from unified.types import Episode, Task, TrajectoryGroup

__all__ = ["TrainingLoop"]

log = logging.getLogger(__name__)

Item = tuple[GroupTicket, TrajectoryGroup]

_YOUNG_COLLECTION_EVERY = 50_000


class _StepAbandoned(Exception):
    """A stop was requested and the step in progress cannot get its groups within the grace."""


@contextmanager
def fewer_young_collections() -> Iterator[None]:
    """Collect the youngest generation every 50,000 allocations instead of 700 while training.

    Each episode allocates a few dozen short-lived objects, nearly all freed by reference
    counting; at the default threshold the collector ran every ~20 episodes and cost a quarter
    of the trainer's time per trajectory (`bench/overhead.py`). The old setting comes back after.
    """
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], _YOUNG_COLLECTION_EVERY), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


class TrainingLoop:
    """The state of one `fit` call and the loop that drives it; `UnifiedTrainer` builds it."""

    def __init__(
        self,
        config: TrainerConfig,
        workflow: WorkflowFn,
        backend: BackendProtocol,
        *,
        train_tasks: Sequence[Task],
        eval_tasks: Sequence[Task],
        run: RunDirectory,
        metrics: MetricsAggregator,
    ) -> None:
        self.config = config
        self.workflow = workflow
        self.backend = backend
        self.train_tasks = train_tasks
        self.eval_tasks = eval_tasks
        self.run_dir = run
        self.metrics = metrics
        settings = config.trainer
        self.sampler = TaskSampler(train_tasks, seed=settings.seed)
        self.coordinator = SyncCoordinator.for_config(config)
        self.groups = TrajectoryGroupBuffer(
            self.coordinator,
            self.sampler,
            run.append_ledger,
            group_size=settings.group_size,
            advantage=settings.advantage,
            filter_groups=settings.filter_groups,
            stall_timeout_s=settings.stall_timeout_s,
            keep_per_group=settings.keep_per_group,
        )
        self.slots = WorkflowSlots.for_config(config)
        self.calls = BackendCalls(backend, settings, self.describe)
        self._loss_finite = True
        self._bad_steps_in_a_row = 0
        self.rollouts = rollout_executor(config, workflow, backend)
        self.step = 0
        self.last_metrics: dict[str, float] = {}
        # Async mode trains a micro-batch as soon as it is ready; sync mode only a whole batch.
        self._train_every = (
            (settings.micro_batch_size or settings.batch_size)
            if config.mode == "async"
            else settings.batch_size
        )
        self._episodes_done = 0
        self._episodes_failed = 0
        self._tokens = 0
        self._time_up = False
        self._started = self._step_started = self._rates_started = time.monotonic()
        self.stop_signal: int | None = None
        """The signal number `request_stop` was called with, once it was."""
        self._saved_step = 0  # the step of the newest checkpoint; step 0 needs none
        self._stop_deadline: float | None = None  # event-loop time the grace ends
        # After a stop: the step in progress (or, between steps, the next one) is the last.
        self._last_step: float = math.inf
        self._ready_wait: asyncio.Timeout | None = None
        # Metrics reach their sinks on a thread of their own, in step order, off the training
        # path; `_drain_logs` waits for them before a checkpoint and in `close`.
        # A daemon thread: a sink stuck for good (past `stall_timeout_s`) holds up no exit.
        self._log_thread = DaemonWorker("unified-metrics")
        self._log_writes: deque[asyncio.Future[None]] = deque()

    # -- start and run ----------------------------------------------------------------------------

    async def start(self, checkpoint: Path | None) -> None:
        """Restore `checkpoint` if given, then evaluate before training."""
        settings = self.config.trainer
        if checkpoint is not None:
            state = await RunDirectory.load_checkpoint(checkpoint, self._load_backend)
            self.step = self._saved_step = state.step
            self.sampler.load_state_dict(state.sampler)
            by_id = {task.id: task for task in self.train_tasks}
            # Checkpoints written before sequence numbers were kept get new ones.
            seqs: list[int | None] = [*state.redispatch_seqs]
            seqs += [None] * (len(state.redispatch) - len(seqs))
            gone = [i for i in state.redispatch if i not in by_id]
            if gone:  # the dataset changed since the checkpoint: those groups cannot run again
                log.warning(
                    "resume: %d group(s) in flight at the checkpoint are not dispatched again: "
                    "their tasks are no longer in data.train (first: %r)",
                    len(gone),
                    gone[0],
                )
            # The backend restored its sampler (weights and version) itself; reopen the window
            # at the point the checkpoint was taken.
            self.groups.restore(
                version=state.version,
                taken=(state.step % self.coordinator.steps_per_window) * settings.batch_size,
                next_seq=state.next_seq,
                redispatch=[
                    (by_id[i], seq)
                    for i, seq in zip(state.redispatch, seqs, strict=True)
                    if i in by_id
                ],
            )
        stopping = self.stop_signal is not None
        if self.step == 0 and settings.eval_before_train and self.eval_tasks and not stopping:
            await self._log(await self._evaluate())
        self.groups.set_wanted(self._groups_wanted(0))
        self._step_started = self._started = self._rates_started = time.monotonic()
        self.groups.take_idle_seconds()

    async def run(self) -> None:
        """Train until `total_steps` (or `max_time_s`, or a stop); the dispatcher runs alongside.

        After a stop, a checkpoint of the last trained step is written unless one exists.
        """
        with fewer_young_collections():
            async with self.rollouts.serving(), asyncio.TaskGroup() as tg:
                dispatcher = tg.create_task(self._dispatch())
                try:
                    while not self.finished and self.step < self._last_step:
                        await self._train_step()
                except _StepAbandoned:
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
        if self.stop_signal is not None:
            return
        self.stop_signal = signal_number
        # Its groups may all be dispatched (even ready) already, if the stop came between steps.
        self._last_step = self.step + 1
        self._stop_deadline = asyncio.get_running_loop().time() + self.config.trainer.stop_grace_s
        self.groups.set_wanted(0)
        if self._ready_wait is not None:
            self._ready_wait.reschedule(self._stop_deadline)

    @property
    def finished(self) -> bool:
        """All `total_steps` done, or the `max_time_s` budget spent by the last step."""
        return self.step >= self.config.trainer.total_steps or self._time_up

    # -- generation -------------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Admit groups whenever the coordinator allows; their workflows run as tasks here.

        While a whole group would find free workflow slots, the coordinator may admit groups
        beyond what the staleness bound holds (`async.over_admit`)."""
        group_size = self.config.trainer.group_size
        max_concurrency = self.config.async_.max_concurrency

        def can_admit() -> bool:
            spare = self.groups.episodes_running + group_size <= max_concurrency
            return self.coordinator.can_admit(spare=spare)

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
        seed = ((settings.seed * 1_000_003 + ticket.seq) * 1_009 + index) % 2**31
        async with self.slots:
            episode, error, tokens = await self.rollouts.run(
                task, index, version=ticket.version, seed=seed
            )
        self._tokens += tokens
        self._episodes_done += 1
        if error is not None:
            self._count_failure(episode, error)
        self._record_tool_calls(episode)
        self.groups.add_episode(ticket, episode)
        if self.groups.unproductive_in_a_row >= settings.max_filtered_in_a_row:
            raise TrainingStopped(self._no_signal_message())

    def _no_signal_message(self) -> str:
        """Why the run stops when every group ends filtered or failed, and what to change."""
        what = (
            f"the last {self.groups.unproductive_in_a_row} groups all ended filtered (equal "
            f"rewards) or failed (last one {self.groups.last_unproductive_reason})"
        )
        if 2 * self.groups.failed_in_a_row > self.groups.unproductive_in_a_row:
            return (
                f"{what}, most of them failed, after {self.step} trained steps: the workflow "
                "errs or times out (episodes/errors, episodes/timeouts and the log say which); fix "
                "it, or raise trainer.workflow_timeout_s if episodes legitimately take longer"
            )
        if self.step == 0:
            return (
                f"{what} before any step trained: the rewards give no learning signal for this "
                "policy; check the workflow's reward and that the model can solve some tasks"
            )
        entropy = self.last_metrics.get("train/entropy")
        seen = f" (train/entropy {entropy:.3g} at the last step)" if entropy is not None else ""
        return (
            f"{what} after {self.step} trained steps: the policy has collapsed onto answers that "
            f"score the same within a group{seen}; resume from an earlier checkpoint with a "
            "lower trainer.lr, or a larger trainer.entropy_coef or trainer.kl_coef"
        )

    def _record_tool_calls(self, episode: Episode) -> None:
        """The `eval/tool_*` metrics of the training episodes, as `rollout/tool_*`: sampled at
        the training temperature, where calls garble first."""
        counted = episode_tool_calls(episode)
        if counted is None:
            return
        calls, errors = counted
        self.metrics.record_many(
            {
                "rollout/tool_calls": calls,
                "rollout/tool_use": calls > 0,
                "rollout/tool_use_well_formed": calls > 0 and errors == 0,
            }
        )
        if calls:  # a share of calls: left out of a step in which nothing was called
            well_formed = [1.0] * (calls - errors) + [0.0] * errors
            self.metrics.record_all("rollout/tool_calls_well_formed", well_formed)

    def _count_failure(self, episode: Episode, error: BaseException) -> None:
        """Count a failed episode; past `max_error_rate`, re-raise its exception."""
        settings = self.config.trainer
        self._episodes_failed += 1
        key = "episodes/timeouts" if episode.status == "timeout" else "episodes/errors"
        self.metrics.record(key, 1.0)
        floor = settings.batch_size * settings.group_size
        if self._episodes_failed > settings.max_error_rate * max(self._episodes_done, floor):
            error.add_note(
                f"unified: {self._episodes_failed} of {self._episodes_done} episodes failed, "
                f"above trainer.max_error_rate={settings.max_error_rate:g}; training stopped"
            )
            raise error

    # -- one optimizer step -----------------------------------------------------------------------

    async def _train_step(self) -> None:
        """Take `batch_size` ready groups (training them as they come in async mode), then step."""
        batch = self.config.trainer.batch_size
        items: list[Item] = []
        wait_s = forward_s = 0.0
        while len(items) < batch:
            started = time.monotonic()
            items.append(await self._next_ready(batch - len(items)))
            wait_s += time.monotonic() - started
            self.groups.set_wanted(self._groups_wanted(len(items)))
            self._record_ended(await self.groups.write_ended(self.step + 1))
            if len(items) % self._train_every == 0 or len(items) == batch:
                first = (len(items) - 1) // self._train_every * self._train_every
                forward_s += await self._forward(items[first:])
        await self._finish_step(items, forward_s=forward_s, wait_s=wait_s)

    async def _next_ready(self, needed: int) -> Item:
        """The next group to train; after a stop, only within the grace and if `needed` more
        groups are still alive (no new ones are dispatched)."""
        if self.stop_signal is not None and self.coordinator.alive < needed:
            raise _StepAbandoned
        wait = self._ready_wait = asyncio.timeout_at(self._stop_deadline)
        try:
            async with wait:
                return await self.groups.next_ready()
        except TimeoutError:
            if wait.expired():
                raise _StepAbandoned from None
            raise
        finally:
            self._ready_wait = None

    async def _forward(self, items: list[Item]) -> float:
        """`forward_backward` on `items` in dispatch order, `micro_batch_size` groups a call."""
        started = time.monotonic()
        ordered = sorted(items, key=lambda item: item[0])
        chunk = self.config.trainer.micro_batch_size or self.config.trainer.batch_size
        for start in range(0, len(ordered), chunk):
            groups = [group for _, group in ordered[start : start + chunk]]
            reply = await self.calls.metrics(
                "forward_backward", functools.partial(self.backend.forward_backward, groups)
            )
            self._loss_finite = self._loss_finite and finite(reply, "train/loss")
            self.metrics.record_many(reply)
        return time.monotonic() - started

    async def _finish_step(self, items: list[Item], *, forward_s: float, wait_s: float) -> None:
        """Optimizer step, ledger, weight sync every `sync_every` steps, metrics, eval, save."""
        settings = self.config.trainer
        items.sort(key=lambda item: item[0])
        version = self.coordinator.version
        train_started = time.monotonic()
        self.backend.set_learning_rate(learning_rate(settings, self.step))
        reply = await self.calls.metrics("optim_step", self.backend.optim_step)
        bad, skipped = self._count_bad_step(reply)
        self.metrics.record_many(reply)
        train_s = forward_s + time.monotonic() - train_started
        self.step += 1
        for ticket, _ in items:
            self._record_rewards(ticket.rewards)
        reason = ""
        if bad:  # a backend that cannot drop the gradients (tinker) applies the update anyway
            done = "update skipped" if skipped else "update applied (the backend cannot skip it)"
            reason = f"{done}: non-finite loss or gradient norm"
        await self.groups.write_trained(items, self.step, version, reason=reason)
        sync_s = 0.0
        if self.step % self.config.async_.sync_every == 0:
            sync_s = await self._sync_weights()
        elif self.step % self.coordinator.steps_per_window == 0:
            self.groups.open_window(self.coordinator.version)
        self._record_ended(await self.groups.write_ended(self.step))  # the requeued, if any
        self.groups.set_wanted(self._groups_wanted(0))
        staleness = [version - group.policy_version for _, group in items]
        now = time.monotonic()
        step_s = now - self._step_started
        # The rollouts run on through evaluation and saving, which no step's time counts: their
        # rates cover the whole time since the last step's, so a slow save neither inflates them
        # nor hides the tokens made during it.
        rates_s, self._rates_started = now - self._rates_started, now
        budget = settings.max_time_s
        # Decided once per step, so the final eval and save see the same answer as the loop.
        self._time_up = budget is not None and time.monotonic() - self._started >= budget
        self.metrics.record_many(
            {
                "groups/trained": float(len(items)),
                # Counters appear every step, zero or not, so curves have no gaps.
                "groups/filtered": 0.0,
                "episodes/errors": 0.0,
                "episodes/timeouts": 0.0,
                "groups/requeued": 0.0,
                **self.groups.take_discarded(),
                "staleness/mean": sum(staleness) / len(staleness),
                "staleness/max": float(max(staleness)),
                "optim/lr": learning_rate(settings, self.step - 1),
                "train/skipped_steps": float(bad),  # bad steps; the ledger says if applied
            }
        )
        per_step = 1.0 / step_s if step_s > 0 else 0.0
        per_interval = 1.0 / rates_s if rates_s > 0 else 0.0
        timing = {
            "step": float(self.step),
            "policy/version": float(self.coordinator.version),
            "time/step": step_s,
            "time/generate": wait_s,
            "time/train": train_s,
            "time/sync": sync_s,
            "throughput/tokens_per_s": self._tokens * per_interval,
            # Every second not spent training or syncing, the trainer was waiting on something.
            "trainer/idle_ratio": max(0.0, step_s - train_s - sync_s) * per_step,
            "rollout/idle_ratio": min(1.0, self.groups.take_idle_seconds() * per_interval),
        }
        self._tokens = 0
        metrics = {**self.metrics.flush(), **timing}
        if self.eval_tasks and self._eval_due():
            metrics.update(await self._evaluate())
        await self._log(metrics)
        periodic = settings.save_every and self.step % settings.save_every == 0
        if periodic or (self.finished and settings.save_final):
            await self._save()
        # Evaluation, logging and saving belong to no step's timing.
        self._step_started = time.monotonic()

    async def _sync_weights(self) -> float:
        """Make the trained weights the next policy version; running workflows carry on."""
        started = time.monotonic()
        version = self.coordinator.version + 1
        await self.calls.call(
            "on_policy_updated", functools.partial(self.backend.on_policy_updated, version)
        )
        self.groups.open_window(version)
        return time.monotonic() - started

    def _count_bad_step(self, reply: dict[str, float]) -> tuple[bool, bool]:
        """Whether this step had a NaN/inf loss or gradient norm, and whether the backend skipped
        its update for it; past `max_bad_steps` bad steps in a row, stop the run."""
        skipped = reply.pop("train/skipped_steps", 0.0) > 0
        bad = skipped or not self._loss_finite or not finite(reply, "train/grad_norm")
        self._loss_finite = True
        if not bad:
            self._bad_steps_in_a_row = 0
            return False, False
        self._bad_steps_in_a_row += 1
        limit = self.config.trainer.max_bad_steps
        if self._bad_steps_in_a_row > limit:
            grad_norm = reply.get("train/grad_norm", math.nan)
            raise TrainingStopped(
                f"{self._bad_steps_in_a_row} optimizer steps in a row had a NaN/inf loss or "
                f"gradient norm (last grad_norm={grad_norm:g}), more than trainer.max_bad_steps="
                f"{limit}: the policy diverged or the rewards/advantages are broken; lower "
                "trainer.lr, check the workflow's rewards, or raise trainer.max_bad_steps"
            )
        return True, skipped

    # -- bookkeeping ------------------------------------------------------------------------------

    def _groups_wanted(self, taken_this_step: int) -> int:
        if self.stop_signal is not None:
            return 0
        settings = self.config.trainer
        remaining = (settings.total_steps - self.step) * settings.batch_size - taken_this_step
        return max(0, remaining)

    def _record_ended(self, ended: list[EndedGroup]) -> None:
        for group in ended:
            self.metrics.record(f"groups/{group.outcome}", 1.0)
            if group.outcome != "requeued":  # its episodes run again: their rewards count then
                self._record_rewards(group.rewards)

    def _record_rewards(self, rewards: Sequence[float]) -> None:
        """Rewards of groups that ended this step (trained or not): `reward/mean`, `/std`."""
        self.metrics.record_all("reward/mean", rewards)
        self.metrics.record_all("reward/std", rewards)

    def _eval_due(self) -> bool:
        every = self.config.trainer.eval_every
        return every > 0 and (self.step % every == 0 or self.finished)

    async def _evaluate(self) -> dict[str, float]:
        settings = self.config.trainer
        return await evaluate(
            self.workflow,
            self.backend.token_sampler(),
            self.eval_tasks,
            self.config.sampling.eval,
            seed=settings.seed,
            version=self.coordinator.version,
            timeout_s=settings.workflow_timeout_s,
            slots=self.slots,
        )

    async def _log(self, metrics: dict[str, float]) -> None:
        """Hand `metrics` to the sinks' thread; a write that failed raises here (or later)."""
        self.last_metrics = metrics
        while self._log_writes and self._log_writes[0].done():
            self._log_writes.popleft().result()
        write = self._log_thread.submit(functools.partial(self.metrics.log, self.step, metrics))
        self._log_writes.append(asyncio.wrap_future(write))

    async def _drain_logs(self) -> None:
        """Wait until every metrics line handed to the sinks is written (within
        `stall_timeout_s`)."""
        writes, self._log_writes = self._log_writes, deque()
        async with self._sink_deadline("writing the metrics of step " + str(self.step)):
            outcomes = await asyncio.gather(*writes, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def close(self) -> None:
        """Finish the metrics writes, then close every sink (the sinks flush as they close)."""
        try:
            await self._drain_logs()
        finally:
            try:  # behind any write still running (one past its deadline): never beside it
                async with self._sink_deadline("closing the metrics sinks"):
                    await self._log_thread.run(self.metrics.close)
            finally:
                self._log_thread.close()

    @asynccontextmanager
    async def _sink_deadline(self, what: str) -> AsyncIterator[None]:
        """`trainer.stall_timeout_s` for a wait on the metrics sinks (a W&B or network-filesystem
        write that never returns must end the run, not hang it)."""
        timeout_s = self.config.trainer.stall_timeout_s
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                yield
        except TimeoutError:
            if not deadline.expired():
                raise
            raise StallError(
                f"{what} took over {timeout_s:g} s: a metrics sink (W&B, TensorBoard, or the "
                "disk of the run directory) is stuck; check it, or raise trainer.stall_timeout_s"
            ) from None

    async def _save(self) -> None:
        await self._drain_logs()  # the metrics of every step the checkpoint holds are written
        in_flight = self.groups.in_flight()
        state = TrainerState(
            step=self.step,
            version=self.coordinator.version,
            next_seq=self.groups.next_seq,
            sampler=self.sampler.state_dict(),
            redispatch=[task_id for task_id, _ in in_flight],
            redispatch_seqs=[seq for _, seq in in_flight],
            ledger_lines=self.run_dir.ledger_lines,
        )
        await self.run_dir.save_checkpoint(state, self._save_backend)
        self._saved_step = self.step

    async def _save_backend(self, directory: Path) -> None:
        await self.calls.call(
            "save_checkpoint", functools.partial(self.backend.save_checkpoint, directory)
        )

    async def _load_backend(self, directory: Path) -> None:
        await self.calls.call(
            "load_checkpoint", functools.partial(self.backend.load_checkpoint, directory)
        )

    def describe(self) -> str:
        """Who is where, for the error of a wait that passed its deadline."""
        running = self.slots.running
        return f"step={self.step}, {self.groups.describe()}, workflows running={running}"

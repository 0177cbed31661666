"""Rollout workers: workflows run on Ray actors; the policy stays with the trainer's backend.

With `rollout.workers: N > 0`, each episode runs in one of N Ray actors (`RolloutWorker`), each
with its own event loop and concurrency limit, so tool and environment work is spread over
processes (and nodes). The trainer keeps admission, groups and the ledger; it gets finished
`Episode`s back. A workflow's model calls come back to the trainer: the worker queues each
request (prompt ids, chat template applied in the worker, and the request's settings), the trainer
long-polls every worker for its queue (`take_requests`), samples them on
`backend.token_sampler()` and delivers the outputs (`deliver`); a call whose workflow gave up
(its timeout) is unsent, or cancelled in the trainer, so the backend stops sampling it. Every
backend works this way, wherever its model lives, and weight syncs stay where they are.

Invariant: every `WorkerPool.run` returns exactly one episode. A worker that dies is detected on
the calls pending on it; its episodes run again (same task, rollout index, version and seed) on
the live workers while a replacement starts, up to `rollout.max_worker_restarts` over the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from unified.config import TrainerConfig
from unified.errors import WorkerError, WorkflowError
from unified.protocol import BackendProtocol, ChatTokenizer, TokenSampler
from unified.ray_runtime import join_ray, start_local_ray
from unified.rollout import (
    EngineClock,
    EpisodeResult,
    InProcessRollouts,
    WorkflowDeadlines,
    WorkflowFn,
    WorkflowSlots,
)
from unified.types import Episode, ModelOutput, SamplingParams, Task

__all__ = ["RolloutWorker", "WorkerPool"]

log = logging.getLogger(__name__)

Request = tuple[int, list[int], SamplingParams]
"""A model call queued by a worker: (call id, prompt ids, the request's complete settings)."""

Taken = tuple[list[Request], list[int]]
"""A long poll's answer: the new requests, and the ids of sent ones whose callers gave up."""

Reply = tuple[int, ModelOutput | BaseException]

_RESTART_PAUSE_S = 1.0
"""Pause after a failed restart, before the next: the cluster may be replacing a node."""

_POLL_S = 5.0
"""How long one `take_requests` long-poll waits for a request before returning empty."""

_ATTEMPTS = 3
"""Runs of one episode whose worker died before it is recorded as an error episode."""

_START_FLOOR_S = 60.0
"""The least a worker gets to come up: a new Ray worker process imports torch and the workflow,
which on a loaded machine takes longer than a short `trainer.stall_timeout_s` allows a call."""


class _TrainerSampler:
    """The policy's `TokenSampler` as seen from inside a worker: the workflow's `SamplingEngine`
    templates and builds the settings here, and each `sample` waits for the trainer's reply."""

    def __init__(self, tokenizer: ChatTokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[ModelOutput]] = {}
        self._queue: list[Request] = []
        self._given_up: list[int] = []
        self._queued = asyncio.Event()

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            raise WorkerError(
                "the backend's tokenizer could not be sent to the rollout workers (not "
                "picklable), and workflows there need it for model.chat and model.tokenizer; "
                "use rollout.workers=0"
            )
        return self._tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        return await self._ask(prompt_ids, params)

    async def _ask(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        call_id = next(self._ids)
        reply: asyncio.Future[ModelOutput] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = reply
        self._queue.append((call_id, list(prompt_ids), params))
        self._queued.set()
        try:
            return await reply
        finally:
            self._waiting.pop(call_id, None)
            if reply.cancelled() or not reply.done():  # the workflow gave up (its timeout)
                self._give_up(call_id)

    def _give_up(self, call_id: int) -> None:
        """Unsend a call whose caller gave up, or tell the trainer to stop running it."""
        unsent = [request for request in self._queue if request[0] == call_id]
        if unsent:
            self._queue.remove(unsent[0])
            return
        self._given_up.append(call_id)
        self._queued.set()

    async def take(self, wait_s: float) -> Taken:
        """The queued requests and the given-up ids, waiting up to `wait_s` for either."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while not self._queue and not self._given_up:  # one unsent since may be gone
                    self._queued.clear()
                    await self._queued.wait()
        taken = (self._queue, self._given_up)
        self._queue, self._given_up = [], []
        self._queued.clear()
        return taken

    def deliver(self, replies: list[Reply]) -> None:
        """Resolve waiting calls; a reply for a call given up on (a timed-out run) is dropped."""
        for call_id, output in replies:
            reply = self._waiting.get(call_id)
            if reply is None or reply.done():
                continue
            if isinstance(output, BaseException):
                reply.set_exception(output)
            else:
                reply.set_result(output)


class RolloutWorker:
    """A Ray actor that runs workflows on its own event loop, at most `concurrency` at once."""

    def __init__(
        self,
        workflow: WorkflowFn,
        tokenizer: ChatTokenizer | None,
        sampling: SamplingParams,
        timeout_s: float,
        concurrency: int,
    ) -> None:
        self._sampler = _TrainerSampler(tokenizer)
        deadlines = WorkflowDeadlines(timeout_s)
        self._rollouts = InProcessRollouts(workflow, lambda: self._sampler, sampling, deadlines)
        self._slots = WorkflowSlots(concurrency)

    async def ready(self) -> int:
        """The worker's process id, once it is up."""
        return os.getpid()

    async def run(self, task: Task, index: int, version: int, seed: int) -> EpisodeResult:
        """One episode, exactly as the trainer process would run it."""
        async with self._slots:
            episode, error, tokens = await self._rollouts.run(
                task, index, version=version, seed=seed
            )
        return episode, _portable(error), tokens

    async def take_requests(self, wait_s: float) -> Taken:
        """The model calls queued since the last take, and those given up on since (long poll,
        up to `wait_s`)."""
        return await self._sampler.take(wait_s)

    async def deliver(self, replies: list[Reply]) -> None:
        """The trainer's outputs (or errors) for earlier requests."""
        self._sampler.deliver(replies)


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` if it survives pickling, else a `WorkflowError` that says what it was."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return WorkflowError(f"{type(error).__name__}: {error}")
    return error


class _Worker:
    """The trainer's record of one live actor."""

    def __init__(self, slot: int, actor: Any) -> None:
        self.slot = slot
        self.actor = actor
        self.in_flight = 0
        self.lost = asyncio.Event()
        self.replies: list[Reply] = []
        self.has_replies = asyncio.Event()
        self.answering: dict[int, asyncio.Task[None]] = {}


class WorkerPool:
    """`rollout.workers` Ray actors running the trainer's rollouts (a `RolloutExecutor`).

    `serving()` joins Ray (or starts a local one), starts the workers and, for each, serves its
    model requests and replaces it when it dies; on exit it kills them, and stops Ray if it
    started it.
    """

    def __init__(
        self,
        config: TrainerConfig,
        workflow: WorkflowFn,
        backend: BackendProtocol,
        sampling: SamplingParams,
        clock: EngineClock | None = None,
    ) -> None:
        self._settings = config.rollout
        self._clock = EngineClock() if clock is None else clock
        self._workflow = workflow
        self._backend = backend
        self._sampling = sampling
        self._workflow_timeout_s = config.trainer.workflow_timeout_s
        # A call to a worker that passes this without a reply means the worker is stuck.
        self._call_timeout_s = config.trainer.stall_timeout_s
        workers = self._settings.workers
        self._concurrency = self._settings.worker_concurrency or -(
            -config.async_.max_concurrency // workers
        )
        self._live: list[_Worker] = []
        self._some_live = asyncio.Event()
        self._slot_freed = asyncio.Event()  # an episode ended on a worker (or a worker came up)
        self._restarts_left = self._settings.max_worker_restarts
        self._keepers_left = workers

    # -- lifecycle --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        started_ray = await asyncio.to_thread(self._join_ray)
        try:
            remote = self._remote_class()
            first = [self._start(remote, slot) for slot in range(self._settings.workers)]
            started = await asyncio.gather(*first, return_exceptions=True)
            failed = [e for e in started if isinstance(e, BaseException)]
            if failed:
                raise WorkerError(
                    f"could not start {len(failed)} of {self._settings.workers} rollout workers: "
                    f"{failed[0]!r}; the workflow must pickle and import in the workers, and "
                    "the Ray cluster needs rollout.worker_cpus free CPUs for each"
                ) from failed[0]
            async with asyncio.TaskGroup() as keepers:
                kept = [
                    keepers.create_task(self._keep(remote, worker))
                    for worker in started
                    if isinstance(worker, _Worker)
                ]
                try:
                    yield
                finally:
                    for task in kept:
                        task.cancel()
        finally:
            for worker in self._live:
                ray.kill(worker.actor, no_restart=True)
            self._live.clear()
            if started_ray:
                await asyncio.to_thread(ray.shutdown)

    def _join_ray(self) -> bool:
        """Connect to `rollout.ray_address`, the running Ray, or a new local one; True if new."""
        if ray.is_initialized():
            return False
        address = self._settings.ray_address
        if address is not None:
            join_ray(address)
        else:
            needed = int(self._settings.workers * self._settings.worker_cpus + 0.999)
            start_local_ray(max(needed, os.cpu_count() or 1))
        return True

    def _remote_class(self) -> Any:
        # Ray serves the async actor's calls on its event loop: the workflows, plus a long poll
        # and the deliveries of replies.
        settings = self._settings
        placement = {"scheduling_strategy": "SPREAD"} if settings.placement == "spread" else {}
        return ray.remote(RolloutWorker).options(
            num_cpus=settings.worker_cpus,
            resources=dict(settings.worker_resources),
            max_concurrency=self._concurrency + 64,
            **placement,
        )

    async def _start(self, remote: Any, slot: int) -> _Worker:
        tokenizer = _portable_tokenizer(self._backend)
        actor = remote.remote(
            self._workflow, tokenizer, self._sampling, self._workflow_timeout_s, self._concurrency
        )
        try:
            async with asyncio.timeout(max(self._call_timeout_s, _START_FLOOR_S)):
                await actor.ready.remote()
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        worker = _Worker(slot, actor)
        self._live.append(worker)
        self._some_live.set()
        self._slot_freed.set()
        return worker

    async def _keep(self, remote: Any, worker: _Worker) -> None:
        """Serve `worker` until it is lost, then replace it while restarts are left (a start
        that fails, say on a node that died meanwhile, uses one up and is tried again)."""
        slot: int = worker.slot
        while True:
            await self._serve(worker)
            self._lose(worker)
            replaced = None
            while replaced is None and self._restarts_left > 0:
                self._restarts_left -= 1
                try:
                    replaced = await self._start(remote, slot)
                except (RayActorError, TimeoutError) as e:
                    log.warning(
                        "rollout worker %d could not be restarted (%r); %d restarts left",
                        slot,
                        e,
                        self._restarts_left,
                    )
                    await asyncio.sleep(_RESTART_PAUSE_S)
            if replaced is None:
                break
            worker = replaced
        self._keepers_left -= 1
        if self._keepers_left == 0:
            self._some_live.set()  # wake waiting runs: there is nothing left to wait for

    def _lose(self, worker: _Worker) -> None:
        """Take `worker` out of service (idempotent); its pending runs see it and go elsewhere."""
        if worker.lost.is_set():
            return
        worker.lost.set()
        self._live.remove(worker)
        if not self._live:
            self._some_live.clear()
        ray.kill(worker.actor, no_restart=True)
        log.warning(
            "rollout worker %d lost with %d episodes in flight; they run again",
            worker.slot,
            worker.in_flight,
        )

    # -- the policy, served to the workers ---------------------------------------------------------

    async def _serve(self, worker: _Worker) -> None:
        """Answer `worker`'s model requests until it dies or stops answering."""
        try:
            async with asyncio.TaskGroup() as serving:
                delivering = serving.create_task(self._deliver(worker))
                while not worker.lost.is_set():
                    async with asyncio.timeout(_POLL_S + self._call_timeout_s):
                        requests, given_up = await worker.actor.take_requests.remote(_POLL_S)
                    sampler = self._backend.token_sampler()
                    for request in requests:
                        answer = serving.create_task(self._answer(worker, sampler, request))
                        worker.answering[request[0]] = answer
                    for call_id in given_up:  # the backend stops sampling for them
                        if (running := worker.answering.pop(call_id, None)) is not None:
                            running.cancel()
                delivering.cancel()
        except* (RayActorError, TimeoutError):
            pass  # lost: the caller replaces it

    async def _answer(self, worker: _Worker, sampler: TokenSampler, request: Request) -> None:
        call_id, prompt_ids, params = request
        output: ModelOutput | BaseException
        try:
            with self._clock.busy():
                output = await sampler.sample(prompt_ids, params)
        except Exception as e:  # the workflow's model call raised: it gets the error
            output = _portable(e) or e
        finally:
            worker.answering.pop(call_id, None)
        worker.replies.append((call_id, output))
        worker.has_replies.set()

    async def _deliver(self, worker: _Worker) -> None:
        """Send the answers back, all those ready in one call (one call per answer costs more
        than the answer). Runs until `_serve` stops, which cancels it."""
        while True:
            await worker.has_replies.wait()
            replies, worker.replies = worker.replies, []
            worker.has_replies.clear()
            async with asyncio.timeout(self._call_timeout_s):
                await worker.actor.deliver.remote(replies)

    # -- episodes ---------------------------------------------------------------------------------

    async def run(self, task: Task, index: int, *, version: int, seed: int) -> EpisodeResult:
        """Run one episode on the least busy live worker; again elsewhere if that one dies."""
        for _ in range(_ATTEMPTS):
            worker = await self._live_worker()
            worker.in_flight += 1
            result = worker.actor.run.remote(task, index, version, seed)
            try:
                async with asyncio.timeout(self._workflow_timeout_s + self._call_timeout_s):
                    episode_result: EpisodeResult = await result
                    return episode_result
            except (RayActorError, TimeoutError):
                self._lose(worker)
            except RayTaskError as e:  # the worker is fine; this episode's result could not be
                message = f"the rollout worker could not run or return it: {e}"  # (unpicklable)
                return _failed(task, index, version, message), e, 0
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    ray.cancel(result)
                raise
            finally:
                worker.in_flight -= 1
                self._slot_freed.set()
        message = f"its rollout worker died {_ATTEMPTS} times running this episode"
        return _failed(task, index, version, message), WorkerError(message), 0

    async def _live_worker(self) -> _Worker:
        """The least busy live worker with a free slot: an episode waits here, not queued inside
        a worker, where its deadline would run while it waits and a healthy worker be lost."""
        while True:
            worker = await self._any_live_worker()
            if worker.in_flight < self._concurrency:
                return worker
            self._slot_freed.clear()
            try:  # every running episode ends within its deadline, freeing a slot
                async with asyncio.timeout(self._workflow_timeout_s + self._call_timeout_s):
                    await self._slot_freed.wait()
            except TimeoutError:
                raise WorkerError(
                    "no rollout worker slot freed within an episode's deadline; see the Ray logs"
                ) from None

    async def _any_live_worker(self) -> _Worker:
        while not self._live:
            if self._keepers_left == 0:
                raise WorkerError(
                    f"every rollout worker died and rollout.max_worker_restarts="
                    f"{self._settings.max_worker_restarts} are used up (failed restarts "
                    "count); see the Ray logs"
                )
            # A replacement's start has its own call_timeout_s: wait past it, for its outcome.
            try:
                async with asyncio.timeout(2 * self._call_timeout_s):
                    await self._some_live.wait()
            except TimeoutError:
                raise WorkerError(
                    f"no rollout worker was live for {2 * self._call_timeout_s:g} s "
                    "(twice trainer.stall_timeout_s); see the Ray logs"
                ) from None
        return min(self._live, key=_in_flight)


def _failed(task: Task, index: int, version: int, message: str) -> Episode:
    return Episode(
        task_id=task.id, rollout_index=index, status="error", error=message, policy_version=version
    )


def _in_flight(worker: _Worker) -> int:
    return worker.in_flight


def _portable_tokenizer(backend: BackendProtocol) -> ChatTokenizer | None:
    tokenizer = backend.token_sampler().tokenizer
    try:
        pickle.dumps(tokenizer)
    except Exception:
        return None
    return tokenizer

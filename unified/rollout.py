"""Running one workflow on one task: the per-request sampling view, slots, the episode runner.

`SamplingEngine` is what a workflow actually receives: over the backend's `TokenSampler`, it
applies the chat template (`unified.chat`), fills in the train or eval sampling settings per
request, and gives each request a reproducible seed. The
runner turns a workflow run into an `Episode`; a workflow's exception or timeout is recorded,
never raised, so one bad rollout cannot take the run down. `WorkflowSlots` bounds how many
workflows run at once and how fast they start; `EngineClock` keeps the time during which no
training request was sampling (`rollout/engine_idle_ratio`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from asyncio_throttle.throttler import Throttler
from pydantic import ValidationError

from unified.chat import chat_prompt_ids
from unified.errors import BackendReplyError, UsageError, WorkflowError
from unified.imports import import_object
from unified.protocol import RolloutEngine, Tokenizer, TokenSampler
from unified.types import (
    CallTimes,
    Episode,
    EpisodeStatus,
    EpisodeTiming,
    ModelOutput,
    SamplingParams,
    Task,
    Trajectory,
)

if TYPE_CHECKING:
    from unified.config import TrainerConfig

__all__ = [
    "EngineClock",
    "EpisodeResult",
    "InProcessRollouts",
    "RolloutExecutor",
    "SamplingEngine",
    "WorkflowDeadlines",
    "WorkflowFn",
    "WorkflowSlots",
    "episode_seed",
    "required_fields",
    "resolve_workflow",
    "run_episode",
    "workflow_serving",
]

WorkflowFn = Callable[[Task, RolloutEngine], Awaitable[Any]]

EpisodeResult = tuple[Episode, BaseException | None, int]
"""One finished rollout: the episode, the exception if it failed, the completion tokens sampled."""


class EngineClock:
    """Seconds during which no training request was sampling: the engine's idle time, as the
    trainer sees it (every request of every rollout, in process or on a worker, runs `busy`)."""

    def __init__(self) -> None:
        self.running = 0
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around one sampling request."""
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if not self.running:
                self._idle_since = time.monotonic()

    def take_idle_seconds(self) -> float:
        """Idle seconds since the last call."""
        idle, self._idle_s = self._idle_s, 0.0
        if self._idle_since is not None:
            now = time.monotonic()
            idle += now - self._idle_since
            self._idle_since = now
        return idle


class SamplingEngine(RolloutEngine):
    """A workflow's view of the policy: the chat template, per-request settings, seeds and token
    accounting, over the backend's `TokenSampler`.

    Each request's `SamplingParams` is built here, once: `defaults` (the train or eval settings,
    shared by every engine of a run; `SamplingParams()` when omitted) with the workflow's own
    keyword overrides, which are validated, since they are the workflow's input; and, unless the
    request names one, the seed `seed * 1000 + call index`.
    """

    def __init__(
        self,
        sampler: TokenSampler,
        defaults: SamplingParams | None = None,
        seed: int | None = None,
        clock: EngineClock | None = None,
    ) -> None:
        self._sampler = sampler
        self._defaults = SamplingParams() if defaults is None else defaults
        self._seed = seed
        self._clock = clock
        self._calls = 0
        self.completion_tokens = 0
        self.call_times: list[CallTimes] = []
        """Each request's wall-clock send and reply times (with its first and last token's
        between, where the sampler reports them), in order: the episode's timing."""

    @property
    def tokenizer(self) -> Tokenizer:
        return cast(Tokenizer, self._sampler.tokenizer)  # see `ChatTokenizer`

    @property
    def sampling_defaults(self) -> SamplingParams:
        return self._defaults

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return chat_prompt_ids(
            self._sampler.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        params = self._params(sampling)  # a bad override fails before the template runs
        return await self._sample(self.encode_chat(messages), params)

    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        return await self._sample(prompt_ids, self._params(sampling))

    async def _sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        sent = time.time()
        with contextlib.nullcontext() if self._clock is None else self._clock.busy():
            output = await self._sampler.sample(prompt_ids, params)
        replied = time.time()
        if not isinstance(output, ModelOutput):
            raise BackendReplyError(
                f"token sampler returned {type(output).__name__}, not ModelOutput (fix the "
                "backend's token_sampler().sample)"
            )
        tokens = output.token_times
        self.call_times.append((sent, *tokens, replied) if tokens else (sent, replied))
        self.completion_tokens += len(output.completion_ids)
        return output

    def _params(self, overrides: dict[str, Any]) -> SamplingParams:
        params = self._defaults
        if overrides:
            params = SamplingParams.model_validate({**params.model_dump(), **overrides})
        if params.seed is None and self._seed is not None:
            params = params.model_copy(update={"seed": self._seed * 1_000 + self._calls})
        self._calls += 1
        return params


class WorkflowSlots:
    """At most `max_concurrency` workflows at once, started no faster than `dispatch_rate` per s.

    Used as `async with slots:` around each workflow run; training and evaluation share one.
    """

    def __init__(self, max_concurrency: int, dispatch_rate: float | None = None) -> None:
        self.running = 0
        self._free = asyncio.Semaphore(max_concurrency)
        self._throttler: Throttler | None = None
        if dispatch_rate is not None:
            # Evenly spaced starts, no bursts: what remote APIs' rate limits expect.
            self._throttler = Throttler(rate_limit=1, period=1.0 / dispatch_rate)

    @classmethod
    def for_config(cls, config: TrainerConfig) -> WorkflowSlots:
        """The slots of a run: `async.max_concurrency` and `async.dispatch_rate`."""
        return cls(config.async_.max_concurrency, config.async_.dispatch_rate)

    async def __aenter__(self) -> None:
        await self._free.acquire()
        if self._throttler is not None:
            try:
                await self._throttler.acquire()  # type: ignore[no-untyped-call]
            except BaseException:
                self._free.release()
                raise
        self.running += 1

    async def __aexit__(self, *exc_info: object) -> None:
        self.running -= 1
        self._free.release()


def episode_seed(run_seed: int, seq: int, index: int) -> int:
    """The sampling seed of rollout `index` of the group with sequence number `seq`: the same
    group (a resumed run dispatches it under its own number) samples the same."""
    return ((run_seed * 1_000_003 + seq) * 1_009 + index) % 2**31


def resolve_workflow(workflow: Any, args: Mapping[str, Any] | None = None) -> WorkflowFn:
    """Turn an import path, a Workflow class or instance, or an async function into a callable.

    A class is instantiated afresh for every episode, with `args` (the config's
    `workflow_args`) as keyword arguments, so workflows may keep per-run state. A workflow that
    declares `serving()` (an async context manager, e.g. `AgentWorkflow`'s gateway) keeps it on
    the callable, for `workflow_serving`.
    """
    if isinstance(workflow, str):
        workflow = import_object(workflow, what="workflow")
    args = dict(args or {})
    if inspect.isclass(workflow):
        cls: Any = workflow
        if not inspect.iscoroutinefunction(getattr(cls, "run", None)):
            raise UsageError(f"workflow class {cls.__name__} needs an `async def run(task, model)`")
        if args:  # one instance now: a bad argument fails at start-up, not in every episode
            try:
                inspect.signature(cls).bind(**args)
                cls(**args)
            except (TypeError, UsageError) as e:
                raise UsageError(f"workflow_args do not fit {cls.__name__}: {e}") from None

        async def run_fresh(task: Task, model: RolloutEngine) -> Any:
            return await cls(**args).run(task, model)

        return _with_serving(run_fresh, cls)
    if args:
        raise UsageError(
            f"workflow_args are given to a workflow class; {workflow!r} is not one: drop them"
        )
    run = getattr(workflow, "run", None)
    if inspect.iscoroutinefunction(run):
        return _with_serving(run, workflow)
    if inspect.iscoroutinefunction(workflow):
        fn: WorkflowFn = workflow
        return fn
    raise UsageError(
        f"workflow {workflow!r} is not an async function or a class with `async def run`"
    )


def _with_serving(run: WorkflowFn, owner: Any) -> WorkflowFn:
    serving = getattr(owner, "serving", None)
    if serving is None:
        return run

    async def serve(task: Task, model: RolloutEngine) -> Any:
        return await run(task, model)

    serve.serving = serving  # type: ignore[attr-defined]
    return serve


def workflow_serving(workflow: WorkflowFn) -> contextlib.AbstractAsyncContextManager[object]:
    """What `workflow` needs running while its episodes run (its `serving()`, e.g. the gateway
    of `AgentWorkflow`), or nothing. Entered around the rollouts of a run and of an evaluation.
    """
    serving = getattr(workflow, "serving", None)
    if serving is None:
        return contextlib.nullcontext()
    manager: contextlib.AbstractAsyncContextManager[object] = serving()
    return manager


def required_fields(workflow: Any) -> tuple[str, ...]:
    """The `task.data` keys a workflow (import path, class, instance or function) declares it
    reads, in its `required_fields`; none if it declares nothing."""
    if isinstance(workflow, str):
        workflow = import_object(workflow, what="workflow")
    return tuple(getattr(workflow, "required_fields", ()))


class WorkflowDeadlines:
    """One timer for many workflow runs: a run still going `timeout_s` after it began is cancelled.

    Every run has the same timeout, so deadlines come in start order: running runs wait in an
    ordered dict and a single `call_at` handle points at the earliest. (An `asyncio.timeout`
    per run costs a timer handle, a heap push and a cancellation each: a sixth of the trainer's
    time per trajectory in `bench/overhead.py`.)
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: OrderedDict[asyncio.Task[Any], float] = OrderedDict()
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> asyncio.Task[Any]:
        """Watch the current task from now on; returns it, for `finish`."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("WorkflowDeadlines.start() must run inside an asyncio task")
        loop = task.get_loop()
        deadline = loop.time() + self.timeout_s
        self._running[task] = deadline
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire, loop)
        return task

    def finish(self, task: asyncio.Task[Any]) -> bool:
        """Stop watching `task`; True if its deadline passed (then it was cancelled for it)."""
        self._running.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        while self._running:
            task, deadline = next(iter(self._running.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire, loop)
                return
            del self._running[task]
            self._expired.add(task)
            task.cancel()


async def run_episode(
    workflow: WorkflowFn,
    task: Task,
    model: RolloutEngine,
    *,
    rollout_index: int,
    version: int,
    deadlines: WorkflowDeadlines,
) -> tuple[Episode, BaseException | None]:
    """Run one workflow; return its episode and, if it failed, the original exception.

    A run past its deadline is cancelled and becomes `status="timeout"`; a cancellation that
    came from elsewhere (the run is ending) propagates; a `CancelledError` the workflow raised of
    its own is an error like any other.
    """
    current = deadlines.start()
    cancelling = current.cancelling()
    try:
        result = await workflow(task, model)
        trajectories = _as_trajectories(result)
    except asyncio.CancelledError as e:
        if deadlines.finish(current):
            if current.uncancel() > cancelling:
                raise
            return _timed_out(task, rollout_index, version, deadlines.timeout_s)
        if current.cancelling() > cancelling:
            raise
        # Nobody cancelled this run: the workflow let out the cancellation of something it
        # awaited. Re-raised, it would end the task silently and its group would never fill.
        message = "CancelledError: the workflow raised it without being cancelled"
        stray = RuntimeError(message)
        stray.__cause__ = e
        return _failed(task, rollout_index, version, "error", message), stray
    except Exception as e:
        if deadlines.finish(current):
            current.uncancel()  # the workflow turned our cancellation into an error of its own
            return _timed_out(task, rollout_index, version, deadlines.timeout_s)
        error = _invalid_output(e) or e
        return _failed(task, rollout_index, version, "error", f"{type(e).__name__}: {e}"), error
    if deadlines.finish(current):
        current.uncancel()  # it swallowed the cancellation, and finished late all the same
        return _timed_out(task, rollout_index, version, deadlines.timeout_s)
    episode = Episode(
        task_id=task.id,
        rollout_index=rollout_index,
        trajectories=trajectories,
        policy_version=version,
    )
    return episode, None


class RolloutExecutor(Protocol):
    """Where the trainer's rollouts run: `run` one episode, inside `serving()` for the whole run."""

    def serving(self) -> contextlib.AbstractAsyncContextManager[object]:
        """Start what `run` needs (workers, their connections) and stop it on exit."""
        ...

    async def run(self, task: Task, index: int, *, version: int, seed: int) -> EpisodeResult:
        """Roll out `task` once (rollout `index`, sampling `seed`) under policy `version`."""
        ...


class InProcessRollouts:
    """Workflows as tasks on the running event loop: the trainer's (`rollout.workers: 0`, the
    default) or a Ray worker's. `sampler` gives the policy's sampler for each run."""

    def __init__(
        self,
        workflow: WorkflowFn,
        sampler: Callable[[], TokenSampler],
        sampling: SamplingParams,
        deadlines: WorkflowDeadlines,
        clock: EngineClock | None = None,
    ) -> None:
        self._workflow = workflow
        self._sampler = sampler
        self._sampling = sampling
        self._deadlines = deadlines
        self._clock = clock

    def serving(self) -> contextlib.AbstractAsyncContextManager[object]:
        return workflow_serving(self._workflow)

    async def run(self, task: Task, index: int, *, version: int, seed: int) -> EpisodeResult:
        engine = SamplingEngine(self._sampler(), self._sampling, seed, self._clock)
        started = time.time()
        episode, error = await run_episode(
            self._workflow,
            task,
            engine,
            rollout_index=index,
            version=version,
            deadlines=self._deadlines,
        )
        episode.timing = EpisodeTiming.model_construct(  # our own floats: nothing to validate
            started=started, ended=time.time(), calls=engine.call_times
        )
        return episode, error, engine.completion_tokens


def _timed_out(
    task: Task, index: int, version: int, timeout_s: float
) -> tuple[Episode, BaseException]:
    message = f"workflow ran past workflow_timeout_s={timeout_s:g} s"
    return _failed(task, index, version, "timeout", message), TimeoutError(message)


def _failed(task: Task, index: int, version: int, status: EpisodeStatus, error: str) -> Episode:
    return Episode(
        task_id=task.id, rollout_index=index, status=status, error=error, policy_version=version
    )


_OUTPUT_TYPES = frozenset({"Trajectory", "Step", "ModelOutput"})


def _invalid_output(error: Exception) -> WorkflowError | None:
    """A `WorkflowError` naming the field, when `error` is the workflow building one of our
    types with bad values (a NaN or string reward, logprobs that do not match the tokens)."""
    if not isinstance(error, ValidationError) or error.title not in _OUTPUT_TYPES:
        return None
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "<root>"
    got = first.get("input")
    shown = f" (got {got!r})" if isinstance(got, str | int | float | type(None)) else ""
    wrapped = WorkflowError(
        f"the workflow built an invalid {error.title}: {field}: {first['msg']}{shown}; fix the "
        f"values the workflow passes to {error.title}(...)"
    )
    wrapped.__cause__ = error
    return wrapped


def _as_trajectories(result: Any) -> list[Trajectory]:
    if isinstance(result, Trajectory):
        items = [result]
    else:
        items = result if isinstance(result, list) else [result]
    if not items or not all(isinstance(t, Trajectory) for t in items):
        got = type(result).__name__
        raise WorkflowError(
            f"workflow returned {got}; it must return a Trajectory (or a list of them)"
        )
    if not any(t.steps for t in items):
        raise WorkflowError(
            "workflow returned a Trajectory with no steps: nothing to train on; add one "
            "Step(messages, output, reward) per model call"
        )
    return items

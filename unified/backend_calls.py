"""The trainer's calls into its backend: each under a deadline, retried only where safe.

A backend call that never returns must end the run, not hang it: every call the trainer makes
(`setup`, `forward_backward`, `optim_step`, `on_policy_updated`, checkpoints, `shutdown`) runs
under `trainer.backend_timeout_s`, and when that passes the error names the call, the deadline and
the pipeline's state (versions, groups in flight, ready, workflows running). Calls that are safe
to repeat are retried after a `TransientBackendError` by `trainer.retry.<call>`; a reply that
breaks the protocol (metrics that are not numbers) is a `BackendReplyError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import numbers
import queue
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from unified.config import TrainerSection
from unified.errors import BackendReplyError, StallError, TrainingInterrupted, first_cause
from unified.protocol import BackendProtocol, RunStatus
from unified.retry import NO_RETRY, retrying

__all__ = [
    "BackendCalls",
    "CallName",
    "DaemonExecutor",
    "DaemonWorker",
    "finite",
    "in_daemon_thread",
    "run_status",
]

T = TypeVar("T")
log = logging.getLogger(__name__)
CallName = Literal[
    "setup",
    "forward_backward",
    "optim_step",
    "on_policy_updated",
    "save_checkpoint",
    "load_checkpoint",
    "shutdown",
    "export_model",
]


def _before_training() -> str:
    return "before training: no group dispatched yet"


class BackendCalls:
    """Runs the trainer's backend calls with a deadline each; `describe` says who is where."""

    def __init__(
        self,
        backend: BackendProtocol,
        settings: TrainerSection,
        describe: Callable[[], str] = _before_training,
    ) -> None:
        self.backend = backend
        self.timeout_s = settings.backend_timeout_s
        self.describe = describe
        self._retry = settings.retry

    async def call(self, what: CallName, make: Callable[[], Awaitable[T]]) -> T:
        """Await `make()` within the deadline; retried after transient errors if `what` is safe."""
        policy = getattr(self._retry, what, NO_RETRY)

        async def attempt() -> T:
            deadline = asyncio.timeout(self.timeout_s)
            try:
                async with deadline:
                    return await make()
            except TimeoutError:
                if not deadline.expired():
                    raise
            raise StallError(
                f"the trainer waited {self.timeout_s:g} s for backend "
                f"{self.backend.name!r} {what}, which never returned ({self.describe()}); the "
                "backend is stuck: check it, or raise trainer.backend_timeout_s if this call is "
                "legitimately this slow"
            )

        return await retrying(f"backend {self.backend.name!r} {what}", attempt, policy)

    async def metrics(
        self, what: Literal["forward_backward", "optim_step"], make: Callable[[], Awaitable[Any]]
    ) -> dict[str, float]:
        """`call`, for the calls that reply with metrics: a mapping of names to numbers."""
        reply = await self.call(what, make)
        if not isinstance(reply, Mapping):
            raise BackendReplyError(
                f"backend {self.backend.name!r} {what} returned {type(reply).__name__}; it must "
                "return a dict of metric names to numbers (fix the backend)"
            )
        bad = {k: v for k, v in reply.items() if not _is_number(v) or not isinstance(k, str)}
        if bad:
            key, value = next(iter(bad.items()))
            raise BackendReplyError(
                f"backend {self.backend.name!r} {what} returned metric {key!r} = {value!r} "
                f"({type(value).__name__}); metric values must be numbers (fix the backend)"
            )
        return {k: float(v) for k, v in reply.items()}

    async def shutdown(self, error: BaseException | None) -> None:
        """Tell the backend how the command ended (`error`, None for success), then shut it
        down within the deadline. The outcome is information only: a hook that fails is logged."""
        try:
            self.backend.set_outcome(*run_status(error))
        except Exception:
            log.exception("backend %r set_outcome failed; shutting it down", self.backend.name)
        await self.call("shutdown", self.backend.shutdown)


def run_status(error: BaseException | None) -> tuple[RunStatus, str | None]:
    """The status a command ending with `error` reports, and a one-line detail."""
    if error is None:
        return "success", None
    error = first_cause(error)
    detail = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    stopped = (TrainingInterrupted, KeyboardInterrupt, asyncio.CancelledError)
    if isinstance(error, BaseExceptionGroup):  # cancellations only: `first_cause` found no other
        return "interrupted", detail
    return ("interrupted" if isinstance(error, stopped) else "errored"), detail


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run blocking `fn` in a daemon thread and await its result.

    For calls that may never return (a remote service that stops answering): a caller past its
    deadline abandons the thread, and neither the event loop's shutdown nor the interpreter's
    exit waits for it, as both do for `asyncio.to_thread`'s threads.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()  # as `asyncio.to_thread` does: the caller's variables

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # the caller gave up on it
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (context.run(fn), None)
        except BaseException as e:
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the loop closed while this thread was stuck
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"unified-{fn!r:.40}", daemon=True).start()
    return await future


class DaemonWorker:
    """One daemon thread that runs blocking calls in turn, until the process exits.

    For clients bound to the thread that made them (a test process that started Ray in a thread
    per call ended with exit 1 when that thread did): a call past its caller's deadline is
    abandoned, and the interpreter's exit does not wait for it, as it would for a pool thread.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]
        self._calls = queue.SimpleQueue()
        self._closed = False
        self._running = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a call is running on the thread now (one stuck there holds every later one)."""
        return self._running

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread after the calls before it; await its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Queue `fn` after the calls before it; its future."""
        if self._closed:
            raise RuntimeError(f"{self._thread.name} is closed")
        future: Future[T] = Future()
        self._calls.put((fn, future))
        return future

    def close(self) -> None:
        """End the thread once the queued calls ran; returns at once (a stuck call keeps it)."""
        self._closed = True
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            self._running = True
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
            finally:
                self._running = False


class DaemonExecutor(ThreadPoolExecutor):
    """The event loop's default executor in `UnifiedTrainer.fit`: `asyncio.to_thread` on daemon
    threads, reused while idle.

    A backend's blocking call past `trainer.backend_timeout_s` is abandoned by the trainer; with
    the stock pool, `asyncio.run` (closing the loop) and the interpreter's exit would then wait
    for that thread forever. Here neither waits: `shutdown` returns at once. Unlike the stock
    pool it has no thread cap: concurrent calls each get a thread (a capped pool would queue
    the calls behind a stuck one).
    """

    def __init__(self, name: str = "unified-blocking") -> None:
        super().__init__(thread_name_prefix=name)  # none of its own threads are ever started
        self._name = name
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._work = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, functools.partial(fn, *args, **kwargs)))
            if self._idle:  # an idle thread takes it
                self._idle -= 1
                return future
            self._started += 1
            name = f"{self._name}_{self._started}"
        threading.Thread(target=self._serve, name=name, daemon=True).start()
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as e:
                    future.set_exception(e)
            del item, future, call  # hold no result while idle
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End every thread once it is idle, and return at once: a call still running was
        abandoned past its deadline."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in range(self._started):
                    self._work.put(None)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite(metrics: Mapping[str, float], *keys: str) -> bool:
    """Whether every one of `keys` present in `metrics` is a finite number."""
    return all(math.isfinite(metrics[k]) for k in keys if k in metrics)

"""Daemon threads for blocking calls that may never return.

A blocking call (a remote service that stops answering, a wedged device call) runs off the event
loop in a daemon thread, so a caller past its deadline can abandon it: neither the event loop's
shutdown nor the interpreter's exit waits for it, as both do for `asyncio.to_thread`'s threads.
`in_daemon_thread` runs one call on a thread of its own; `DaemonWorker` runs calls in turn on one
thread (clients bound to the thread that made them); `DaemonExecutor` is the event loop's default
executor in `UnifiedTrainer.fit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["DaemonExecutor", "DaemonWorker", "in_daemon_thread"]

T = TypeVar("T")


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

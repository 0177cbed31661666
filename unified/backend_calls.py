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
import functools
import logging
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from unified.config import TrainerSection
from unified.errors import BackendReplyError, StallError, TrainingInterrupted, first_cause
from unified.protocol import BackendProtocol, RunStatus
from unified.retry import NO_RETRY, retrying
from unified.types import TrajectoryGroup

__all__ = [
    "BackendCalls",
    "CallName",
    "finite",
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

    async def forward_backward(
        self, groups: Sequence[TrajectoryGroup], per_call: int
    ) -> list[dict[str, float]]:
        """`forward_backward` on `groups` in their order, `per_call` groups a call; the replies."""
        replies = []
        for start in range(0, len(groups), per_call):
            chunk = list(groups[start : start + per_call])
            make = functools.partial(self.backend.forward_backward, chunk)
            replies.append(await self.metrics("forward_backward", make))
        return replies

    async def on_policy_updated(self, version: int) -> None:
        """The weight sync to policy `version`, within the deadline."""
        await self.call(
            "on_policy_updated", functools.partial(self.backend.on_policy_updated, version)
        )

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


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite(metrics: Mapping[str, float], *keys: str) -> bool:
    """Whether every one of `keys` present in `metrics` is a finite number."""
    return all(math.isfinite(metrics[k]) for k in keys if k in metrics)

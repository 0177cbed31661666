"""Retries of backend calls that are safe to repeat: exponential backoff with jitter.

One helper for the trainer and every backend. Only a `TransientBackendError` is retried: each
backend maps its own passing failures (timeouts, HTTP 5xx and 429, dropped connections) to it, and
any other error propagates at once. A call is retried only where repeating it cannot change the
result: sampling, set-up that creates a fresh client, a weight sync, writing or reading a
checkpoint. `forward_backward` and `optim_step` are never retried (a repeat would add the
gradients twice or step the optimizer twice).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from unified.errors import TransientBackendError

__all__ = ["NO_RETRY", "RetryPolicy", "retrying"]

T = TypeVar("T")


class RetryPolicy(BaseModel):
    """How often and how patiently one kind of call is retried after a transient error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(4, ge=1, description="Tries in all, the first included (1: no retry).")
    backoff_s: float = Field(0.5, ge=0, description="Delay before the second try; doubles after.")
    max_backoff_s: float = Field(30.0, ge=0, description="Longest delay between two tries.")
    jitter: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of each delay drawn at random (0: none; 1: full jitter), so clients "
        "that failed together do not retry together.",
    )

    def delay_s(self, retry: int, draw: float) -> float:
        """The delay before retry number `retry` (0-based); `draw` is uniform in [0, 1)."""
        base = min(self.max_backoff_s, self.backoff_s * 2.0**retry)
        return base * (1.0 - self.jitter * draw)


NO_RETRY = RetryPolicy(attempts=1)
"""For calls that are not safe to repeat."""


async def retrying(
    what: str,
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    rng: random.Random | None = None,
) -> T:
    """Await `call()`; after a `TransientBackendError` wait and try again: `policy.attempts` tries.

    The last failure is raised as a `TransientBackendError` naming `what` and the attempts, with
    the original chained.
    """
    draws = rng if rng is not None else random.Random()
    for attempt in range(policy.attempts):
        try:
            return await call()
        except TransientBackendError as e:
            if attempt + 1 == policy.attempts:
                if policy.attempts == 1:
                    raise
                raise TransientBackendError(
                    f"{what} failed {policy.attempts} times in a row; last: {e}"
                ) from e
        await asyncio.sleep(policy.delay_s(attempt, draws.random()))
    raise AssertionError("unreachable: the loop returns or raises")

"""The life of a backend in one command (`train`, `eval`, `sft`): set up, called, shut down.

`backend_session` is the one place that keeps the backend's contract with the commands: every
call under the trainer's deadline and retries (`BackendCalls`); `will_load_checkpoint` before
`setup` when a checkpoint follows; and `shutdown` always, last, once, told how the command ended
(`set_outcome`), also when the command failed before the backend was set up. A shutdown that
fails is the command's error, or a note on the error already ending it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from unified.backend_calls import BackendCalls
from unified.config import TrainerConfig
from unified.errors import first_cause
from unified.protocol import BackendProtocol

__all__ = ["BackendSession", "backend_session"]


class BackendSession:
    """A backend between its start and its shutdown: `calls` runs each call with its deadline."""

    def __init__(self, backend: BackendProtocol, config: TrainerConfig, describe: str) -> None:
        self.backend = backend
        self.describe: Callable[[], str] = lambda: describe
        self.calls = BackendCalls(backend, config.trainer, lambda: self.describe())

    async def setup(self, config: TrainerConfig, *, loads_checkpoint: bool = False) -> None:
        """`setup` the backend for `config`; `loads_checkpoint`: `load_checkpoint` follows."""
        if loads_checkpoint:
            self.backend.will_load_checkpoint()
        await self.calls.call("setup", functools.partial(self.backend.setup, config))

    async def save_checkpoint(self, directory: Path) -> None:
        """The backend's state into `directory` (a checkpoint being written)."""
        await self.calls.call(
            "save_checkpoint", functools.partial(self.backend.save_checkpoint, directory)
        )

    async def load_checkpoint(self, directory: Path) -> None:
        """The backend's state from `directory` (a checkpoint being restored)."""
        await self.calls.call(
            "load_checkpoint", functools.partial(self.backend.load_checkpoint, directory)
        )


@asynccontextmanager
async def backend_session(
    backend: BackendProtocol, config: TrainerConfig, *, describe: str
) -> AsyncIterator[BackendSession]:
    """Yield the session of `backend`; on the way out, shut it down with the outcome.

    `describe` names the command in deadline errors until `session.describe` is replaced (the
    training loop says which step and which groups)."""
    session = BackendSession(backend, config, describe)
    error: BaseException | None = None
    try:
        yield session
    except BaseException as e:
        error = e
        raise
    finally:
        try:
            await session.calls.shutdown(error)
        except Exception as failure:
            if error is None:
                raise
            # On the cause, not a task group around it: the command raises the cause.
            first_cause(error).add_note(f"unified: the backend's shutdown also failed: {failure!r}")

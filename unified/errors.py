"""The error hierarchy of `unified`.

Every error a user can cause derives from `UnifiedError`; the CLI turns a `UsageError` into one
line on stderr and exit code 2. Messages name the thing, the value and the fix.
"""

from __future__ import annotations

import asyncio

__all__ = [
    "BackendError",
    "BackendReplyError",
    "CapabilityError",
    "ConfigError",
    "DataError",
    "StallError",
    "TrainingInterrupted",
    "TrainingStopped",
    "TransientBackendError",
    "UnifiedError",
    "UsageError",
    "WorkerError",
    "WorkflowError",
    "first_cause",
]


class UnifiedError(Exception):
    """Base class of every error raised by `unified` itself."""


class UsageError(UnifiedError):
    """The user asked for something that cannot work: bad config, data or import path (exit 2)."""


class ConfigError(UsageError):
    """A config key is unknown, has the wrong type, or an invalid value."""


class CapabilityError(UsageError):
    """A config knob the chosen backend cannot honour."""


class DataError(UsageError):
    """A dataset is missing, empty or malformed."""


class WorkflowError(UsageError):
    """A workflow returned something that is not a valid `Trajectory` (a bug to fix: exit 2)."""


class BackendError(UnifiedError):
    """A backend call failed, or the backend replied with something that breaks the protocol."""


class TransientBackendError(BackendError):
    """A backend call failed in a way that may pass (timeout, HTTP 5xx/429, dropped connection).

    Each backend maps its own transient failures to this type; `unified.retry` retries only it,
    and only for calls that are safe to repeat.
    """


class BackendReplyError(BackendError, UsageError):
    """A backend's reply breaks the protocol (wrong type or shape): its code needs a fix."""


class StallError(UnifiedError):
    """A wait passed its deadline: the thing awaited made no progress."""


class TrainingStopped(UnifiedError):
    """Training cannot make progress (e.g. every group is filtered); the message says why."""


class TrainingInterrupted(UnifiedError):
    """SIGINT or SIGTERM stopped training in order; the newest checkpoint holds the run, and
    `resume=true` continues it. The CLI exits with `exit_code` (128 + the signal number)."""

    def __init__(self, message: str, *, signal_number: int) -> None:
        super().__init__(message)
        self.signal_number = signal_number

    @property
    def exit_code(self) -> int:
        """130 for SIGINT, 143 for SIGTERM: the shell's code for a process ended by the signal."""
        return 128 + self.signal_number


class WorkerError(UnifiedError):
    """Rollout workers cannot start, or every one of them died and none may be restarted."""


def first_cause(error: BaseException) -> BaseException:
    """The original exception inside (nested) task-group errors, not the group wrapper: the
    first that is not a cancellation (the group itself if all are), or `error` if no group."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    inner: tuple[BaseException, ...] = error.exceptions
    for exc in inner:
        if isinstance(exc, BaseExceptionGroup):
            return first_cause(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return error

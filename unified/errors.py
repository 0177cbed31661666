"""The error hierarchy of `unified`.

Every error a user can cause derives from `UnifiedError`; the CLI turns a `UsageError` into one
line on stderr and exit code 2. Messages name the thing, the value and the fix.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "CapabilityError",
    "ConfigError",
    "DataError",
    "StallError",
    "TrainingStopped",
    "UnifiedError",
    "UsageError",
    "WorkerError",
    "WorkflowError",
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


class WorkflowError(UnifiedError):
    """A workflow returned something that is not a valid `Trajectory`."""


class BackendError(UnifiedError):
    """A backend replied with something that breaks the protocol."""


class StallError(UnifiedError):
    """A wait passed its deadline: the thing awaited made no progress."""


class TrainingStopped(UnifiedError):
    """Training cannot make progress (e.g. every group is filtered); the message says why."""


class WorkerError(UnifiedError):
    """Rollout workers cannot start, or every one of them died and none may be restarted."""

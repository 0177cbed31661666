"""unified: one trainer for RL post-training of LLM policies and agents, on any backend.

`import unified` is light: each public name below loads its module on first use (PEP 562), so
`from unified.types import Task` in a workflow or a backend does not load the trainer, and torch,
tinker, verl, ray and wandb load only where they are used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unified.config import TrainerConfig, load_config
    from unified.coordinator import SyncCoordinator
    from unified.groups import TrajectoryGroupBuffer
    from unified.metrics import MetricsAggregator
    from unified.protocol import BackendCapabilities, BackendProtocol, RolloutEngine, TokenSampler
    from unified.sequences import TrainingSequence, sequences_of
    from unified.trainer import TrainResult, UnifiedTrainer
    from unified.types import (
        Episode,
        ModelOutput,
        SamplingParams,
        Step,
        Task,
        Trajectory,
        TrajectoryGroup,
        Transcript,
    )

_MODULE_OF = {
    "BackendCapabilities": "unified.protocol",
    "BackendProtocol": "unified.protocol",
    "Episode": "unified.types",
    "MetricsAggregator": "unified.metrics",
    "ModelOutput": "unified.types",
    "RolloutEngine": "unified.protocol",
    "SamplingParams": "unified.types",
    "Step": "unified.types",
    "SyncCoordinator": "unified.coordinator",
    "Task": "unified.types",
    "TokenSampler": "unified.protocol",
    "TrainResult": "unified.trainer",
    "TrainerConfig": "unified.config",
    "TrainingSequence": "unified.sequences",
    "Trajectory": "unified.types",
    "TrajectoryGroup": "unified.types",
    "TrajectoryGroupBuffer": "unified.groups",
    "Transcript": "unified.types",
    "UnifiedTrainer": "unified.trainer",
    "load_config": "unified.config",
    "sequences_of": "unified.sequences",
}

__all__ = [
    "BackendCapabilities",
    "BackendProtocol",
    "Episode",
    "MetricsAggregator",
    "ModelOutput",
    "RolloutEngine",
    "SamplingParams",
    "Step",
    "SyncCoordinator",
    "Task",
    "TokenSampler",
    "TrainResult",
    "TrainerConfig",
    "TrainingSequence",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryGroupBuffer",
    "Transcript",
    "UnifiedTrainer",
    "load_config",
    "sequences_of",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'unified' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

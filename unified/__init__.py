"""unified: one trainer for RL post-training of LLM policies and agents, on any backend.

`import unified` stays light: torch, tinker, verl, ray and wandb load only where they are used.
"""

from unified.config import TrainerConfig, load_config
from unified.coordinator import SyncCoordinator
from unified.groups import TrajectoryGroupBuffer
from unified.loop import TrainingLoop
from unified.metrics import MetricsAggregator
from unified.protocol import BackendCapabilities, BackendProtocol, RolloutEngine
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
    "TrainResult",
    "TrainerConfig",
    "TrainingLoop",
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

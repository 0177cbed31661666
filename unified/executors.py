"""Where workflows run: in the trainer's process, or on Ray rollout workers (`rollout.workers`).

`rollout_executor` is the one place that picks; the loop asks it once per run. It sits above
both executors (`unified.rollout.InProcessRollouts`, `unified.workers.WorkerPool`), so neither
module imports the other's caller.
"""

from __future__ import annotations

from unified.config import TrainerConfig
from unified.errors import UsageError
from unified.protocol import BackendProtocol
from unified.rollout import InProcessRollouts, RolloutExecutor, WorkflowDeadlines, WorkflowFn

__all__ = ["rollout_executor"]


def rollout_executor(
    config: TrainerConfig, workflow: WorkflowFn, backend: BackendProtocol
) -> RolloutExecutor:
    """The executor `rollout.workers` asks for: in process (0), or on that many Ray workers."""
    sampling = config.sampling.train
    if config.rollout.workers == 0:
        deadlines = WorkflowDeadlines(config.trainer.workflow_timeout_s)
        return InProcessRollouts(workflow, backend.token_sampler, sampling, deadlines)
    try:
        from unified.workers import WorkerPool  # imports Ray, only when asked for
    except ImportError as e:
        raise UsageError(
            f"rollout.workers={config.rollout.workers} needs Ray ({e}); install it "
            "(pip install 'unified[verl]' brings it) or set rollout.workers=0"
        ) from e

    return WorkerPool(config, workflow, backend, sampling)

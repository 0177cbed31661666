"""Where workflows run: in the trainer's process, or on Ray rollout workers (`rollout.workers`).

`rollout_executor` is the one place that picks; the loop asks it once per run. It sits above
both executors (`unified.rollout.InProcessRollouts`, `unified.workers.WorkerPool`), so neither
module imports the other's caller. `fewer_young_collections` is the garbage-collector setting
the loop runs its rollouts under.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from unified.config import TrainerConfig
from unified.errors import UsageError
from unified.protocol import BackendProtocol
from unified.rollout import (
    EngineClock,
    InProcessRollouts,
    RolloutExecutor,
    WorkflowDeadlines,
    WorkflowFn,
)

__all__ = ["fewer_young_collections", "rollout_executor"]


def rollout_executor(
    config: TrainerConfig,
    workflow: WorkflowFn,
    backend: BackendProtocol,
    clock: EngineClock | None = None,
) -> RolloutExecutor:
    """The executor `rollout.workers` asks for: in process (0), or on that many Ray workers;
    each sampling request runs under `clock`."""
    sampling = config.sampling.train
    if config.rollout.workers == 0:
        deadlines = WorkflowDeadlines(config.trainer.workflow_timeout_s)
        return InProcessRollouts(workflow, backend.token_sampler, sampling, deadlines, clock)
    try:
        from unified.workers import WorkerPool  # imports Ray, only when asked for
    except ImportError as e:
        raise UsageError(
            f"rollout.workers={config.rollout.workers} needs Ray ({e}); install it "
            "(pip install 'unified[verl]' brings it) or set rollout.workers=0"
        ) from e

    return WorkerPool(config, workflow, backend, sampling, clock)


_YOUNG_COLLECTION_EVERY = 50_000


@contextmanager
def fewer_young_collections() -> Iterator[None]:
    """Collect the youngest generation every 50,000 allocations instead of 700 while training.

    Each episode allocates a few dozen short-lived objects, nearly all freed by reference
    counting; at the default threshold the collector ran every ~20 episodes and cost a quarter
    of the trainer's time per trajectory (`bench/overhead.py`). The old setting comes back after.
    """
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], _YOUNG_COLLECTION_EVERY), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)

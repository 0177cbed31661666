"""Learning-rate schedules, counted in optimizer steps (never tasks or groups)."""

from __future__ import annotations

import math

from unified.config import TrainConfig

__all__ = ["learning_rate"]


def learning_rate(t: TrainConfig, step: int) -> float:
    """The rate of optimizer step `step` (0-based): linear warm-up, then the schedule to zero."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps)
    if t.lr_schedule == "linear":
        return t.lr * (1.0 - progress)
    if t.lr_schedule == "cosine":
        return t.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.lr

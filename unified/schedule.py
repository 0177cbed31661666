"""Learning-rate schedules, counted in optimizer steps (never tasks or groups)."""

from __future__ import annotations

import math

from unified.config import TrainerSection

__all__ = ["learning_rate"]


def learning_rate(settings: TrainerSection, step: int) -> float:
    """The rate of optimizer step `step` (0-based): linear warm-up, then the schedule to zero."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.total_steps - settings.warmup_steps)
    if settings.lr_schedule == "linear":
        return settings.lr * (1.0 - progress)
    if settings.lr_schedule == "cosine":
        return settings.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.lr

"""Per-step schedules, counted in optimizer steps (never tasks or groups): the learning rate, and
the entropy coefficient under `trainer.entropy_target`."""

from __future__ import annotations

import math

from unified.config import TrainerSection

__all__ = ["EntropyControl", "learning_rate"]


def learning_rate(settings: TrainerSection, step: int) -> float:
    """The rate of optimizer step `step` (0-based): linear warm-up, then the schedule to zero."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.total_steps - settings.warmup_steps)
    if settings.lr_schedule == "linear":
        return settings.lr * (1.0 - progress)
    if settings.lr_schedule == "cosine":
        return settings.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if settings.lr_schedule == "wsd":
        left = settings.total_steps - step  # steps from this one to the end, this one included
        return settings.lr * min(1.0, left / settings.resolved_decay_steps)
    return settings.lr


class EntropyControl:
    """The entropy bonus's coefficient, kept by the loop and set on the backend before each step.

    Fixed at `entropy_coef` without a target. With `entropy_target` (modelled on Skywork-OR1's
    adaptive entropy control) it starts there and, after each step, moves `entropy_coef_step` up
    when the step's entropy was below the target and down when above, within
    [0, `entropy_coef_max`]: a fixed bonus that holds entropy on one run can let it collapse or
    run away on another.
    """

    def __init__(self, settings: TrainerSection) -> None:
        self.target = settings.entropy_target
        self.step_size = settings.entropy_coef_step
        self.high = settings.entropy_coef_max
        self.coef = settings.entropy_coef

    @property
    def adaptive(self) -> bool:
        """Whether the coefficient moves (a target is set)."""
        return self.target is not None

    def update(self, entropy: float | None) -> float:
        """Move the coefficient after a step whose `train/entropy` was `entropy`; the new one.

        A step that measured no entropy (every group filtered) leaves it where it is.
        """
        if self.target is not None and entropy is not None and math.isfinite(entropy):
            move = self.step_size if entropy < self.target else -self.step_size
            self.coef = min(self.high, max(0.0, self.coef + move))
        return self.coef

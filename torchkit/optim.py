"""The optimizer step of every torch trainer here: clip the gradients, skip a non-finite step,
step, clear. Used by the local backend and the Tinker-compatible server.

Invariant: a step whose loss or gradient norm is NaN or infinite changes nothing (weights and
optimizer state stay as they were); the gradients are cleared either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["OptimStep", "clipped_step"]


class OptimStep(NamedTuple):
    """What one `clipped_step` did."""

    grad_norm: float  # of the gradients before clipping
    skipped: bool  # the loss or `grad_norm` was not finite: nothing was updated


def clipped_step(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    *,
    max_grad_norm: float | None,
    finite_loss: bool = True,
) -> OptimStep:
    """Clip the gradients of `params` to `max_grad_norm` (None: no clipping) and step
    `optimizer`, unless `finite_loss` is False or the norm is not finite; then clear them."""
    limit = math.inf if max_grad_norm is None else max_grad_norm
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
    skipped = not (finite_loss and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return OptimStep(grad_norm, skipped)

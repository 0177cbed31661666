"""The policy worker: verl's `TrainingWorker` (one Ray actor per data-parallel rank) plus two calls.

Everything verl's worker does (FSDP engine, micro-batching, `ppo_loss`, checkpoints) is verl's;
this subclass adds what our protocol needs and verl's worker lacks:
- `train_step`: `train_mini_batch` at the learning rate the trainer's schedule chose (verl would
  otherwise step its own scheduler);
- `export_weights`: the full (unsharded) weights, gathered by every rank, returned by rank 0, for
  the weight sync into the local sampler.
On CPU the process group is gloo, initialised here before verl's worker would try
"cpu:gloo,cpu:gloo" (verl builds the string from the device name and its collective backend).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.single_controller.base.decorator import (
    Dispatch,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.workers.engine_workers import TrainingWorker

__all__ = ["PolicyWorker"]


class PolicyWorker(TrainingWorker):  # type: ignore[misc]
    """verl's training worker with a scheduled learning rate and a full-weights export."""

    def __init__(self, config: Any) -> None:
        if get_device_name() == "cpu" and not dist.is_initialized():
            dist.init_process_group(
                backend="gloo",
                rank=int(os.environ.get("RANK", "0")),
                world_size=int(os.environ.get("WORLD_SIZE", "1")),
            )
        super().__init__(config)

    @register(
        dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False
    )  # type: ignore[untyped-decorator]
    def train_step(self, data: TensorDict) -> TensorDict | None:
        """One optimizer step on `data` at its `learning_rate` (a non-tensor entry)."""
        lr = tu.pop(data, key="learning_rate", default=None)
        if lr is not None:
            for group in self.engine.optimizer.param_groups:
                group["lr"] = float(lr)
        result: TensorDict | None = self.train_mini_batch(data)
        return result

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights as CPU tensors on rank 0 (None elsewhere); every rank must call it."""
        params, _ = self.engine.get_per_tensor_param()
        weights = {name: tensor.detach().to("cpu").clone() for name, tensor in params}
        return weights if self.rank == 0 else None

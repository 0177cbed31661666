"""The policy worker: verl's `TrainingWorker` (a Ray actor per data-parallel rank) and three calls.

Everything verl's worker does (FSDP engine, micro-batching, `ppo_loss`, checkpoints) is verl's;
this subclass adds what our protocol needs and verl's worker lacks:
- `train_step`: `train_mini_batch` at the learning rate the trainer's schedule chose (verl would
  otherwise step its own scheduler);
- `export_weights`: the full (unsharded) weights, gathered by every rank, returned by rank 0, for
  the weight sync into the local sampler (staged in pinned host memory on a GPU);
- `compute_ref_log_prob`: the frozen reference's log-probs for the KL loss. As in verl's
  `ActorRolloutRefWorker`, the reference is a second, forward-only `TrainingWorker` in the same
  process (mesh `ref`), built from the initial weights by `start_reference` and never trained.
On CPU the process group is gloo, initialised here before verl's worker would try
"cpu:gloo,cpu:gloo" (verl builds the string from the device name and its collective backend).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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

from backends.verl.weights import HostStaging, Wire, to_wire

__all__ = ["PolicyWorker"]


class PolicyWorker(TrainingWorker):  # type: ignore[misc]
    """verl's training worker: a scheduled learning rate, a full-weights export, a KL reference."""

    def __init__(self, config: Any, reference: Any = None) -> None:
        if get_device_name() == "cpu" and not dist.is_initialized():
            dist.init_process_group(
                backend="gloo",
                rank=int(os.environ.get("RANK", "0")),
                world_size=int(os.environ.get("WORLD_SIZE", "1")),
            )
        super().__init__(config)
        self.reference_config = reference
        self.ref: TrainingWorker | None = None
        self.staging = HostStaging()

    def node_id(self) -> str:
        """The Ray node this rank runs on (the driver names it when the rank is lost)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]
    def start_reference(self) -> None:
        """Build the frozen reference from the initial weights (every rank must call it)."""
        if get_device_name() == "cpu":
            _unpin_forward_only_offload()
        self.ref = TrainingWorker(config=self.reference_config)
        self.ref.reset()
        self.set_dispatch_collect(mesh_name="ref", **self.ref.get_dispatch_collect())

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"), blocking=False)  # type: ignore[untyped-decorator]
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict | None:
        """The reference's log-probs of `data` (verl's `ActorRolloutRefWorker` call)."""
        if self.ref is None:
            raise RuntimeError("the verl reference is not built; start_reference() first")
        output = self.ref.infer_batch(data=data)
        return output.cpu() if output is not None else None

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
    def export_weights(
        self, skip: Sequence[str] = (), dtype: str | None = None
    ) -> dict[str, Wire] | None:
        """The full weights on rank 0 but the names in `skip` (None elsewhere), in the form
        `to_wire` gives, cast to `dtype` (a torch dtype's name; None: as trained); every rank
        must call it (each full tensor is a collective gather)."""
        cast = getattr(torch, dtype) if dtype else None
        params, _ = self.engine.get_per_tensor_param()
        staged = {
            name: self.staging.copy_in(name, tensor.detach(), cast)
            for name, tensor in params
            if self.rank == 0 and name not in skip
        }
        self.staging.wait()
        return {name: to_wire(t) for name, t in staged.items()} if self.rank == 0 else None


def _unpin_forward_only_offload() -> None:
    """On CPU, let verl's forward-only FSDP2 engine offload to host memory without pinning it.

    verl gives a forward-only engine (the reference) `CPUOffloadPolicy(pin_memory=True)`, and
    pinning needs an accelerator. Without one the parameters live in host memory either way.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    class UnpinnedOffloadPolicy(CPUOffloadPolicy):  # type: ignore[misc]
        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    transformer_impl.CPUOffloadPolicy = UnpinnedOffloadPolicy

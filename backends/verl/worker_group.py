"""The driver's handle on the policy workers: Ray, verl's `RayWorkerGroup`, and its calls.

`PolicyGroup.start` joins a Ray cluster (or starts a private one on 127.0.0.1), places one
`PolicyWorker` per data-parallel rank with verl's `RayResourcePool` and its `RayWorkerGroup`
(watched for lost ranks: `watch.WatchedWorkerGroup`), builds the
FSDP engine (`reset`), the frozen reference when a KL loss needs one (`start_reference`), and
installs the loss (verl's `ppo_loss` with the KL term every backend uses, `ppo_loss_with_kl`).
Its calls follow verl's trainer (`RayPPOTrainer._compute_old_log_prob` / `_compute_ref_log_prob`
/ `_update_actor`): padded `DataProto` -> no-padding TensorDict -> worker call -> padded results.
Every call blocks: the backend runs them in a thread.
`shutdown` stops only what `start` started.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from verl import DataProto

from backends.verl.algorithms import ppo_loss_with_kl, without_kl
from backends.verl.convert import micro_batch_rows, to_no_padding
from backends.verl.weights import from_wire, with_aliases
from unified.errors import BackendError

__all__ = ["PolicyGroup", "placement"]


class PolicyGroup:
    """A Ray worker group of `PolicyWorker`s training one policy (data parallel over workers)."""

    def __init__(
        self,
        worker_config: Any,
        actor_config: Any,
        *,
        reference_config: Any = None,
        num_workers: int,
        device: str,
        ray_address: str | None,
        kl_clamp: float | None = None,
    ) -> None:
        self.worker_config = worker_config
        self.actor_config = actor_config
        self.reference_config = reference_config
        self.num_workers = num_workers
        self.device = device
        self.ray_address = ray_address
        self.kl_clamp = kl_clamp
        self._group: Any = None
        self._pool: Any = None
        self._started_ray = False

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or join) Ray, place the workers, build their engines and loss."""
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool

        from backends.verl.watch import WatchedWorkerGroup
        from backends.verl.worker import PolicyWorker
        from unified.ray_runtime import join_ray, start_local_ray

        env = self._worker_environment()
        if self.device == "cpu":
            # The driver places the workers through verl's platform too (Ray resource "CPU").
            from verl.plugin.platform import set_platform

            from backends.verl.cpu_platform import CPUPlatform

            set_platform(CPUPlatform())
        if not ray.is_initialized():
            if self.ray_address is None:
                start_local_ray(
                    max(self.num_workers, os.cpu_count() or 1),
                    num_gpus=0 if self.device == "cpu" else None,
                    runtime_env={"env_vars": env},
                )
            else:
                join_ray(self.ray_address, runtime_env={"env_vars": env})
            self._started_ray = True
        self._check_resources(ray.available_resources())
        kind = "GPU" if self.device == "cuda" else "CPU"
        nodes = [n["Resources"].get(kind, 0.0) for n in ray.nodes() if n.get("Alive")]
        self._pool = pool = RayResourcePool(
            process_on_nodes=placement(self.num_workers, nodes, kind),
            use_gpu=self.device == "cuda",
            max_colocate_count=1,
        )
        worker = RayClassWithInitArgs(
            ray.remote(PolicyWorker), config=self.worker_config, reference=self.reference_config
        )
        self._group = WatchedWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=worker,
            device_name=self.device,
            worker_env=env,
        )
        self._group.reset()
        if self.reference_config is not None:
            self._group.start_reference()
        loss = partial(
            ppo_loss_with_kl,
            config=self.actor_config,
            pg_config=without_kl(self.actor_config),
            kl_clamp=self.kl_clamp,
        )
        self._group.set_loss_fn(loss)

    def _check_resources(self, available: dict[str, float]) -> None:
        """Refuse a group the cluster cannot place: Ray would wait for the bundles forever."""
        kind = "GPU" if self.device == "cuda" else "CPU"
        have = available.get(kind, 0.0)
        if have < self.num_workers:
            raise BackendError(
                f"verl.num_workers={self.num_workers} needs {self.num_workers} {kind}s free in "
                f"the Ray cluster, which has {have:g}; lower verl.num_workers or add nodes"
            )

    def _worker_environment(self) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.device == "cpu":
            from backends.verl.cpu_platform import cpu_environment

            threads = max(1, (os.cpu_count() or 1) // self.num_workers)
            env |= cpu_environment() | {"OMP_NUM_THREADS": str(threads)}
        return env

    def shutdown(self) -> None:
        """Stop the workers, and Ray if `start` started it."""
        import ray

        if self._group is not None:
            for handle in self._group.workers:
                ray.kill(handle)
            self._group = None
        # Give the bundles back: on a cluster (or a Ray that outlives this run) they stay
        # reserved until removed, and the next group in this process could not be placed.
        from ray.util import remove_placement_group

        for placement_group in getattr(self._pool, "pgs", None) or []:
            with contextlib.suppress(Exception):
                remove_placement_group(placement_group)
        self._pool = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    @property
    def group(self) -> Any:
        """verl's `RayWorkerGroup` (raises if `start` has not run)."""
        if self._group is None:
            raise BackendError("the verl worker group is not running; call setup() first")
        return self._group

    # -- calls ----------------------------------------------------------------------------------

    def batch_multiple(self, rows: int, most_per_micro_batch: int) -> tuple[int, int]:
        """(rows per micro-batch, the multiple a batch of `rows` is padded to)."""
        micro = micro_batch_rows(rows, self.num_workers, most_per_micro_batch)
        return micro, micro * self.num_workers

    def compute_logprobs(
        self, batch: DataProto, *, temperature: float, micro_batch: int
    ) -> torch.Tensor:
        """The workers' log-probs of every response token [B, R] (verl's `compute_log_prob`)."""
        return self._infer(self.group.infer_batch, batch, temperature, micro_batch)

    def compute_ref_logprobs(
        self, batch: DataProto, *, temperature: float, micro_batch: int
    ) -> torch.Tensor:
        """The frozen reference's log-probs [B, R] (verl's `compute_ref_log_prob`)."""
        if self.reference_config is None:
            raise BackendError("the verl workers hold no reference model (trainer.kl_coef is 0)")
        return self._infer(self.group.compute_ref_log_prob, batch, temperature, micro_batch)

    def _infer(
        self, call: Any, batch: DataProto, temperature: float, micro_batch: int
    ) -> torch.Tensor:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = to_no_padding(
            batch,
            calculate_entropy=False,
            compute_loss=False,
            temperature=temperature,
            micro_batch_size_per_gpu=micro_batch,
        )
        output = call(td).get()
        logprobs = no_padding_2_padding(tu.get(output, "log_probs"), td)
        return logprobs.float().cpu()

    def train(
        self, batch: DataProto, *, lr: float, temperature: float, micro_batch: int
    ) -> dict[str, float]:
        """One optimizer step on `batch` (verl's `update_actor`); verl's metrics, reduced."""
        from verl.utils import tensordict_utils as tu

        rows = len(batch)
        real_rows = int(batch.meta_info.get("real_rows", rows))
        td = to_no_padding(
            batch,
            calculate_entropy=True,
            distillation_use_topk=False,
            distillation_only=False,
            # One mini-batch: the whole step is one optimizer update, like every backend.
            global_batch_size=real_rows,
            mini_batch_size=rows,
            epochs=1,
            seed=int(self.actor_config.data_loader_seed),
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
            temperature=temperature,
            learning_rate=lr,
            micro_batch_size_per_gpu=micro_batch,
        )
        output = self.group.train_step(td).get()
        return _reduce(tu.get(output, "metrics"))

    def export_weights(
        self, tied: Mapping[str, str] | None = None, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """The full trained weights (gathered from the shards), as CPU tensors in `dtype` (None:
        as trained).

        `tied` maps names tied to another (see `tied_aliases`) to it: they are not sent, and
        come back as that name's tensor.
        """
        tied = tied or {}
        wire_dtype = str(dtype).removeprefix("torch.") if dtype else None
        results = self.group.export_weights(skip=list(tied), dtype=wire_dtype)
        sent = next((r for r in results if r is not None), None)
        if sent is None:
            raise BackendError("no verl worker returned the exported weights")
        return with_aliases({name: from_wire(w) for name, w in sent.items()}, tied)

    def save_checkpoint(self, directory: Path, *, step: int) -> None:
        """verl's checkpoint of model, optimizer and RNG shards into `directory` (every rank);
        the trainer owns retention (each run checkpoint holds one), so verl keeps them all."""
        self.group.save_checkpoint(str(directory), None, step, None)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore what `save_checkpoint` wrote into `directory`."""
        self.group.load_checkpoint(str(directory), None, False)


def placement(workers: int, nodes: list[float], kind: str) -> list[int]:
    """Workers per placement group: verl packs each group on one node, so a group larger than
    the biggest node is split into node-sized groups (as verl's own trainer does), or refused
    when it does not divide (Ray would wait for the bundles forever)."""
    biggest = int(max(nodes, default=0.0))
    if workers <= biggest:
        return [workers]
    hosts = sum(int(n) // biggest for n in nodes) if biggest else 0  # nodes a group fits on
    if biggest == 0 or workers % biggest or hosts < workers // biggest:
        raise BackendError(
            f"verl.num_workers={workers} must fit one node or be a multiple of the biggest "
            f"node's {biggest} {kind}s with as many nodes that size (each holds one packed "
            "group of workers)"
        )
    return [biggest] * (workers // biggest)


def _reduce(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's per-micro-batch metric lists as floats (verl's own `reduce_metrics`)."""
    from verl.utils.metric import reduce_metrics

    reduced = reduce_metrics(dict(metrics))
    return {
        key: float(np.asarray(value, dtype=np.float64).mean())
        for key, value in reduced.items()
        if np.isscalar(value) or isinstance(value, np.ndarray | float | int | torch.Tensor)
    }

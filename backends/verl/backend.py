"""VerlBackend: verl's engine workers (FSDP2 on a Ray worker group) train; a local sampler samples.

Training is verl's: `forward_backward` turns groups into training sequences and stages them;
`optim_step` runs one `train_mini_batch` on them as verl's batch rows (verl's engine does forward,
backward and the optimizer step in one call, so streamed accumulation is exact: one update per
step). With `trainer.kl_coef > 0` the workers also hold a frozen reference (verl's `ref` role,
the initial weights): `optim_step` first scores the rows with it, and verl's KL loss uses those
log-probs. Sampling is the torch kit's `BatchingSampler` on its own copy of the weights
(verl's vLLM/SGLang servers are not wired in yet, on any device). `on_policy_updated(v)` gathers
the trained weights from the workers and loads them into the sampler's spare copy, which it swaps
in: a batch running at the sync finishes on its own weights, and the sync waits for no workflow.
Checkpoints are verl's own layout (`global_step_N/actor`, `latest_checkpointed_iteration.txt`)
plus the sampler's weights. Every worker-group call runs on one daemon thread under
`verl.call_timeout_s`.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel
from verl import DataProto

from backends.verl.algorithms import LOSS_AGGREGATIONS
from backends.verl.config import (
    VerlConfig,
    compose_verl_config,
    hydra_overrides,
    parse_verl_config,
    reference_worker_config,
    resolved_device,
    resolved_param_dtype,
    training_worker_config,
)
from backends.verl.convert import to_batch
from backends.verl.weights import tied_aliases
from backends.verl.worker_group import PolicyGroup
from torchkit.builtin import is_builtin, load_policy, save_policy
from torchkit.sampler import BatchingSampler
from torchkit.snapshots import load_sampler_weights, read_meta, restore_sampler, save_sampler
from torchkit.vllm_engine import VllmSampler
from unified.config import TrainerConfig
from unified.errors import BackendError, UsageError
from unified.protocol import BackendCapabilities, BackendProtocol, TokenSampler
from unified.sequences import TrainingSequence, scoring_temperature, sequences_of
from unified.threads import DaemonWorker, in_daemon_thread
from unified.types import TrajectoryGroup

__all__ = ["VerlBackend"]

T = TypeVar("T")

_TRACKER = "latest_checkpointed_iteration.txt"  # verl's name for the newest global step

# verl's metric names -> ours (docs/backends.md lists the contract).
_METRICS = {
    "loss": "train/loss",
    "actor/ppo_kl": "train/kl_sample_train",
    "actor/entropy_loss": "train/entropy",
    "actor/pg_clipfrac": "train/clip_frac",
    "grad_norm": "train/grad_norm",
    "kl_loss": "train/kl_reference",
}


def check_saved_workers(meta: dict[str, Any], num_workers: int) -> None:
    """Refuse a checkpoint sharded over another number of workers (verl cannot reshard it)."""
    saved = meta.get("num_workers", num_workers)
    if saved != num_workers:
        raise UsageError(
            f"this verl checkpoint holds {saved} workers' shards; resume with "
            f"verl.num_workers={saved} (it is {num_workers})"
        )


class VerlBackend(BackendProtocol):
    """verl's FSDP2 training workers on Ray, with the local sampler holding the synced weights."""

    name: ClassVar[str] = "verl"
    # The `verl:` section's model: `--dry-run` shows its defaults.
    section_model: ClassVar[type[BaseModel]] = VerlConfig
    # verl takes one scoring temperature per call, and its engine always clips gradients.
    capabilities = BackendCapabilities(
        losses=frozenset({"ppo", "cispo", "importance_sampling"}),
        partial_rollout=True,
        loss_aggregations=frozenset(LOSS_AGGREGATIONS),
        scoring_temperature="per_step",
        unclipped_gradients=False,
    )

    def __init__(self) -> None:
        self.settings = VerlConfig()
        self._group: PolicyGroup | None = None
        self._pending: list[TrainingSequence] = []
        self._lr: float | None = None
        self._calls: DaemonWorker | None = None  # made by the first worker-group call
        self.steps = 0

    # -- set-up -------------------------------------------------------------------------------

    def check_config(self, config: TrainerConfig) -> None:
        parse_verl_config(config)

    async def setup(self, config: TrainerConfig) -> None:
        self.settings = parse_verl_config(config)
        self.config = config
        self._lr = config.trainer.lr
        self.device = resolved_device(self.settings)
        self.model_dir = await asyncio.to_thread(self._model_directory, config)
        model, self.tokenizer = await asyncio.to_thread(load_policy, str(self.model_dir))
        if self.device == "cuda":
            model = model.to("cuda")
        self.sampler: BatchingSampler | VllmSampler
        if self.settings.engine == "vllm":
            self.sampler = VllmSampler.start(
                self.model_dir,
                self.settings.vllm,
                tokenizer=self.tokenizer,
                key="verl.vllm",
                partial_rollout=bool(config.async_.partial_rollout),
                load_timeout_s=config.trainer.backend_timeout_s,
            )
            await self.sampler.warm_up()
        else:
            self.sampler = BatchingSampler(
                model,
                self.tokenizer,
                max_batch=self.settings.max_batch,
                partial_rollout=bool(config.async_.partial_rollout),
                prefix_cache_mb=self.settings.prefix_cache_mb,
            )
        self.tied = tied_aliases(model)  # not sent at a weight sync: refilled here
        # Under bf16 mixed precision the workers' forward sees the weights in bf16: a sync sends
        # the sampler exactly those values, in half the bytes of the fp32 master weights.
        self.sync_dtype = torch.bfloat16 if resolved_param_dtype(self.settings) == "bf16" else None
        overrides = hydra_overrides(config, self.settings, self.model_dir)
        composed = await asyncio.to_thread(compose_verl_config, overrides)
        await asyncio.to_thread(self._record, config, composed)
        worker_config, actor_config = training_worker_config(composed)
        self._group = PolicyGroup(
            worker_config,
            actor_config,
            reference_config=reference_worker_config(composed),
            num_workers=self.settings.num_workers,
            device=self.device,
            ray_address=self.settings.ray_address,
            kl_clamp=self.settings.kl_clamp,
        )
        await self._call("start the verl worker group", self._group.start)

    def _model_directory(self, config: TrainerConfig) -> Path:
        """A local model directory verl can load: built-in models are written into the run."""
        if not is_builtin(config.model):
            return Path(config.model)
        directory = config.run_path / "verl" / config.model.replace(":", "-")
        if not (directory / "config.json").exists():
            save_policy(*load_policy(config.model), directory)
        return directory

    def _record(self, config: TrainerConfig, composed: Any) -> None:
        from omegaconf import OmegaConf

        target = config.run_path / "verl" / "verl_config.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(OmegaConf.to_yaml(composed))

    def token_sampler(self) -> TokenSampler:
        return self.sampler

    def set_learning_rate(self, lr: float) -> None:
        self._lr = lr

    @property
    def group(self) -> PolicyGroup:
        """The running worker group."""
        if self._group is None:
            raise BackendError("the verl backend is not set up; call setup() first")
        return self._group

    # -- training -----------------------------------------------------------------------------

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self._pending += await asyncio.to_thread(self._sequences, groups)
        return {}

    def _sequences(self, groups: list[TrajectoryGroup]) -> list[TrainingSequence]:
        # verl's loss has the KL and entropy terms: nothing folds into the advantages.
        loss, sampling = self.config.trainer.loss, self.config.sampling.train
        return sequences_of(groups, loss=loss, temperature=sampling.temperature)

    async def optim_step(self) -> dict[str, float]:
        sequences, self._pending = self._pending, []
        self.steps += 1
        if not sequences:
            return {"train/grad_norm": 0.0}
        batch, micro = await self._batch(sequences)
        if self.config.trainer.kl_coef > 0:
            batch.batch["ref_log_prob"] = await self._call(
                "scoring with the reference",
                self.group.compute_ref_logprobs,
                batch,
                temperature=self._temperature(sequences),
                micro_batch=micro,
            )
        lr = self._lr if self._lr is not None else self.config.trainer.lr
        metrics = await self._call(
            "a training step",
            self.group.train,
            batch,
            lr=lr,
            temperature=self._temperature(sequences),
            micro_batch=micro,
        )
        reply = {ours: metrics[theirs] for theirs, ours in _METRICS.items() if theirs in metrics}
        if not math.isfinite(metrics.get("grad_norm", 0.0)):
            # verl's engine zeroes the gradients of a non-finite norm instead of stepping: the
            # update was skipped, and the trainer's trainer.max_bad_steps decides what follows.
            reply["train/skipped_steps"] = 1.0
        return reply

    def _temperature(self, sequences: list[TrainingSequence]) -> float:
        """The one temperature a batch is scored at (verl takes one per call): its sequences'
        scoring temperature, under which greedy and temperature-1 calls score alike."""
        found = {seq.temperature for seq in sequences}
        if len(found) > 1:
            raise BackendError(f"one verl batch mixes sampling temperatures {sorted(found)}")
        if found:
            return found.pop()
        loss, sampling = self.config.trainer.loss, self.config.sampling.train
        return scoring_temperature(None, loss=loss, default=sampling.temperature)

    async def _batch(self, sequences: list[TrainingSequence]) -> tuple[DataProto, int]:
        """verl's padded batch of `sequences` and its rows per micro-batch."""
        most = self.settings.forward_batch_size
        micro, multiple = self.group.batch_multiple(len(sequences), most)
        pad = self.tokenizer.pad_token_id or 0
        batch = await asyncio.to_thread(
            functools.partial(
                to_batch, sequences, pad_token_id=pad, multiple=multiple, micro_batch=micro
            )
        )
        return batch, micro

    async def score(
        self, groups: list[TrajectoryGroup], *, reference: bool = False
    ) -> list[list[float]]:
        """Every row's model-token log-probs under the workers' policy (verl's `compute_log_prob`),
        or under the frozen reference with `reference=True` (`compute_ref_log_prob`)."""
        sequences = self._sequences(groups)
        batch, micro = await self._batch(sequences)
        call = self.group.compute_ref_logprobs if reference else self.group.compute_logprobs
        logprobs_BR = await self._call(
            "scoring", call, batch, temperature=self._temperature(sequences), micro_batch=micro
        )
        mask_BR = batch.batch["response_mask"].bool()
        return [logprobs_BR[p][mask_BR[p]].tolist() for p in batch.meta_info["real_positions"]]

    # -- weight sync --------------------------------------------------------------------------

    async def on_policy_updated(self, version: int) -> None:
        weights = await self._call(
            "gathering the trained weights", self.group.export_weights, self.tied, self.sync_dtype
        )
        # A request running now finishes on the weights it began with (the built-in sampler's
        # spare copy; vLLM's pause mode `wait`), or with partial rollouts continues on these.
        await load_sampler_weights(self.sampler, weights, version)

    # -- checkpoints --------------------------------------------------------------------------

    async def save_checkpoint(self, directory: Path) -> None:
        await self.sampler.wait_idle()
        actor = directory / f"global_step_{self.steps}" / "actor"
        await asyncio.to_thread(actor.mkdir, parents=True, exist_ok=True)
        await self._call(
            "saving a verl checkpoint",
            self.group.save_checkpoint,
            actor,
            step=self.steps,
        )
        await asyncio.to_thread(self._save_sampler, directory)

    def _save_sampler(self, directory: Path) -> None:
        (directory / _TRACKER).write_text(str(self.steps))
        # verl saves one shard per worker: a resume needs as many.
        save_sampler(
            self.sampler, directory, steps=self.steps, num_workers=self.settings.num_workers
        )

    async def load_checkpoint(self, directory: Path) -> None:
        await self.sampler.wait_idle()
        tracker = directory / _TRACKER
        if not tracker.exists():
            raise BackendError(f"{directory} holds no verl checkpoint ({_TRACKER} is missing)")
        steps = int(tracker.read_text().strip())
        meta = await asyncio.to_thread(read_meta, directory)
        check_saved_workers(meta, self.settings.num_workers)
        actor = directory / f"global_step_{steps}" / "actor"
        await self._call("loading a verl checkpoint", self.group.load_checkpoint, actor)
        await restore_sampler(self.sampler, directory, meta)
        self.steps = steps

    async def export_model(self, directory: Path) -> None:
        """Write the trained policy as a Hugging Face model directory."""
        weights = await self._call(
            "gathering the trained weights", self.group.export_weights, self.tied
        )
        await asyncio.to_thread(self._export, weights, directory)

    def _export(self, weights: dict[str, torch.Tensor], directory: Path) -> None:
        model, tokenizer = load_policy(str(self.model_dir))
        model.load_state_dict(weights)
        save_policy(model, tokenizer, directory)

    async def shutdown(self) -> None:
        if hasattr(self, "sampler"):
            await self.sampler.wait_idle()
            if isinstance(self.sampler, VllmSampler):
                self.sampler.shutdown()
        if self._group is None:
            return
        what = "stopping the verl worker group"
        if self._calls is None or not self._calls.busy:  # on Ray's thread, like every call
            await self._call(what, self._group.shutdown)
        else:  # queued behind the stuck call it would never run: on a thread of its own
            limit = self.settings.call_timeout_s
            try:
                async with asyncio.timeout(limit):
                    await in_daemon_thread(self._group.shutdown)
            except TimeoutError as e:
                raise BackendError(f"verl backend: {what} took more than {limit:g} s") from e
        self._group = None

    async def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking worker-group call within `verl.call_timeout_s`, on the backend's one
        daemon thread: a call stuck past it is abandoned and does not hold the process's exit."""
        limit = self.settings.call_timeout_s
        if self._calls is None:
            self._calls = DaemonWorker("verl-calls")
        try:
            async with asyncio.timeout(limit):
                return await self._calls.run(functools.partial(fn, *args, **kwargs))
        except TimeoutError as e:
            raise BackendError(f"verl backend: {what} took more than {limit:g} s") from e

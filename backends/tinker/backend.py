"""TinkerBackend: train through the real `tinker` SDK, on the service or a compatible server.

- set-up: `ServiceClient(base_url, api_key)`, `create_lora_training_client(model, rank)`; with no
  `base_url` and no key it first starts the local server in a child process on loopback.
- sampling: the backend is its own `TokenSampler`: each request goes to the `SamplingClient` of
  the newest version, many in flight; a request keeps the client it started on, so a weight sync
  never disturbs it.
- training: `forward_backward` submits and returns; `optim_step` submits right behind it and
  awaits both, so the server works while later groups still generate.
- weight sync: `save_weights_and_get_sampling_client` (a new client per version).
- checkpoints: `save_state`; the run's checkpoint records the `tinker://` path, and resume makes
  the client with `create_training_client_from_state_with_optimizer`.
Every remote call has a deadline; idempotent ones retry transient errors with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import numpy as np
import tinker
from pydantic import BaseModel
from tinker.lib.base_url import resolve_base_url
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from backends.tinker.config import TinkerConfig
from backends.tinker.datums import to_datum
from backends.tinker.server_process import ServerProcess
from torchkit.builtin import load_tokenizer
from unified.config import TrainerConfig
from unified.errors import BackendError, ConfigError, TransientBackendError, UsageError
from unified.protocol import BackendCapabilities, BackendProtocol, RunStatus, TokenSampler
from unified.redaction import register
from unified.retry import NO_RETRY, retrying
from unified.sequences import TrainingSequence, fold_kl_penalty, sampled_entropy, sequences_of
from unified.threads import in_daemon_thread
from unified.types import ModelOutput, SamplingParams, TrajectoryGroup

log = logging.getLogger(__name__)

__all__ = ["TinkerBackend"]

T = TypeVar("T")
LOCAL_KEY = "tml-local-server"
_TRANSIENT = (
    tinker.APIConnectionError,
    tinker.APITimeoutError,
    tinker.InternalServerError,
    tinker.RateLimitError,
)


@dataclass
class _Pending:
    """A submitted forward_backward and the sequences it scores."""

    future: Any
    sequences: list[TrainingSequence]


class TinkerBackend(BackendProtocol):
    """LoRA training and sampling on Tinker through the pinned SDK."""

    name: ClassVar[str] = "tinker"
    # The `tinker:` section's model: `--dry-run` shows its defaults.
    section_model: ClassVar[type[BaseModel]] = TinkerConfig
    # Tinker's built-in losses have neither a KL nor an entropy term: both fold into advantages.
    # They score at temperature 1, and sum token losses (token_mean divides by the call's tokens).
    capabilities = BackendCapabilities(
        partial_rollout=False,
        loss_aggregations=frozenset({"token_mean", "token_sum"}),
        scoring_temperature="one",
        adaptive_entropy=True,
    )

    def __init__(self) -> None:
        self.settings = TinkerConfig()
        self.lr = 1e-4
        self.entropy_coef = 0.0
        self._pending: list[_Pending] = []
        self._server: ServerProcess | None = None
        self._service: tinker.ServiceClient | None = None
        self.base_url: str | None = None
        self._outcome: tuple[RunStatus, str | None] = ("success", None)
        self._training: tinker.TrainingClient | None = None
        self._load_next = False

    # -- set-up -------------------------------------------------------------------------------

    async def setup(self, config: TrainerConfig) -> None:
        self.check_config(config)
        self.settings = settings = TinkerConfig.from_section(config.tinker)
        self.config = config
        self.lr = config.trainer.lr
        self.entropy_coef = config.trainer.entropy_coef
        key = os.environ.get(settings.api_key_env) or None
        register(key)
        base_url = settings.base_url
        if settings.resolved_service(key) == "offline":
            base_url = await self._start_local_server(config)
            why = (
                "tinker.service is offline"
                if settings.service == "offline"
                else f"no ${settings.api_key_env} and no tinker.base_url"
            )
            key = LOCAL_KEY
            log.warning(
                "tinker: %s, so this run trains offline on a local Tinker-compatible server "
                "(unified tinker-serve at %s, model %s; config.yaml says tinker.service: "
                "offline); for Thinking Machines' service set %s=tml-...",
                why,
                base_url,
                config.model,
                settings.api_key_env,
            )
        elif key is None:
            raise UsageError(
                f"tinker: no API key for {base_url or 'the Tinker service'}; set "
                f"{settings.api_key_env}=tml-... (or tinker.service: offline)"
            )
        # Also where the SDK goes without one ($TINKER_BASE_URL or Tinker's service): its own
        # retries would take request_timeout_s a try to report a network that is down.
        await self._check_reachable(base_url or resolve_base_url(None))
        self.base_url = base_url
        self.base_model = settings.base_model or config.model
        try:
            self._service = tinker.ServiceClient(base_url=base_url, api_key=key)
        except tinker.TinkerError as e:
            raise UsageError(f"tinker: {e} (from ${settings.api_key_env})") from e
        service = self._service
        # The KL reference is the base model: a LoRA client that is never trained (its adapters
        # start at zero) scores a whole batch in one `forward`, not a request per sequence.
        # The first call of a ServiceClient blocks while it opens the session: `blocking=True`.
        self.reference: tinker.TrainingClient | None = None
        if config.trainer.kl_coef > 0:
            self.reference = await self._remote(
                "create_lora_training_client (KL reference)",
                lambda: service.create_lora_training_client(
                    self.base_model, **_lora_shape(settings)
                ),
                idempotent=True,
                blocking=True,
            )
        if self._load_next:
            return  # `load_checkpoint` makes the policy's client from the saved state
        training = await self._remote(
            "create_lora_training_client",
            lambda: service.create_lora_training_client(self.base_model, **_lora_shape(settings)),
            idempotent=True,
            blocking=True,
        )
        await self._use_policy(training, version=0)

    def will_load_checkpoint(self) -> None:
        # Tinker makes a client from saved state, and has no call to drop one: a fresh policy
        # client made by `setup` first would stay on the service, untrained, all session.
        self._load_next = True

    @property
    def training(self) -> tinker.TrainingClient:
        """The policy's training client."""
        if self._training is None:
            raise BackendError(
                "tinker: no policy client: the trainer said a checkpoint would be loaded after "
                "setup, and none was"
                if self._load_next
                else "tinker: no policy client: setup() has not run, or failed"
            )
        return self._training

    async def _use_policy(self, training: tinker.TrainingClient, *, version: int) -> None:
        """Train `training` from now on, and sample its weights as policy `version`."""
        self._training = training
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
        self._publish(await self._new_sampling_client(), version=version)

    def resolve_config(self, config: TrainerConfig) -> TrainerConfig:
        settings = TinkerConfig.from_section(config.tinker)
        key = os.environ.get(settings.api_key_env) or None
        section = {**config.tinker, "service": settings.resolved_service(key)}
        return config.model_copy(update={"tinker": section})

    def check_config(self, config: TrainerConfig) -> None:
        TinkerConfig.from_section(config.tinker)
        micro = config.trainer.micro_batch_size
        if (
            config.trainer.loss_agg == "token_mean"
            and micro is not None
            and micro < config.trainer.batch_size
        ):
            raise ConfigError(
                f"trainer.loss_agg token_mean averages each forward_backward call on its own "
                f"on tinker: with trainer.micro_batch_size {micro} < batch_size "
                f"{config.trainer.batch_size} a step would sum the means of its micro-batches "
                "(short ones weigh more per token); set trainer.loss_agg: token_sum, or leave "
                "trainer.micro_batch_size unset"
            )

    async def _start_local_server(self, config: TrainerConfig) -> str:
        from backends.tinker.server_process import ServerProcess

        store = self.settings.local_store or config.run_path / "tinker-store"
        self._server = ServerProcess(
            config.model,
            store=store.resolve(),
            max_batch=self.settings.local_max_batch,
            engine=self.settings.local_engine,
            vllm=self.settings.local_vllm,
        )
        return await self._server.start(self.settings.request_timeout_s)

    async def _check_reachable(self, base_url: str) -> None:
        """Fail in one line, fast, when nothing listens at `base_url` (the SDK would retry)."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                await client.get(f"{base_url.rstrip('/')}/api/v1/healthz")
        except httpx.HTTPError as e:
            raise UsageError(
                f"tinker: cannot reach {base_url} ({type(e).__name__}); start a server with "
                "`unified tinker-serve` or fix tinker.base_url"
            ) from e

    def _load_tokenizer(self) -> PreTrainedTokenizerBase:
        name = self.settings.tokenizer or self.training.get_info().model_data.tokenizer_id
        if not name:
            raise UsageError("tinker: the server names no tokenizer; set tinker.tokenizer")
        if Path(name).is_dir():
            return load_tokenizer(Path(name))
        return AutoTokenizer.from_pretrained(name)

    # -- remote calls -------------------------------------------------------------------------

    async def _remote(
        self,
        what: str,
        submit: Callable[[], Awaitable[T]],
        *,
        idempotent: bool = False,
        blocking: bool = False,
    ) -> T:
        """Submit a call and await its result within the deadline; idempotent calls are retried
        after transient errors (`tinker.retries`)."""
        timeout_s = self.settings.request_timeout_s

        async def attempt() -> T:
            try:
                async with asyncio.timeout(timeout_s):
                    future = await in_daemon_thread(submit) if blocking else submit()
                    return await future
            except tinker.AuthenticationError as e:
                raise UsageError(
                    f"tinker: {self.base_url or 'the service'} refused the API key in "
                    f"${self.settings.api_key_env} (HTTP 401)"
                ) from e
            except tinker.RequestFailedError as e:
                if e.category == tinker.types.RequestErrorCategory.User:
                    raise BackendError(f"tinker {what} failed: {e}") from e
                raise TransientBackendError(f"tinker {what} failed: {e}") from e
            except TimeoutError as e:
                raise TransientBackendError(
                    f"tinker {what} got no result within tinker.request_timeout_s={timeout_s:g} s"
                ) from e
            except _TRANSIENT as e:
                raise TransientBackendError(f"tinker {what} failed: {type(e).__name__}: {e}") from e
            except tinker.TinkerError as e:
                raise BackendError(f"tinker {what} failed: {e}") from e

        policy = self.settings.retry_policy() if idempotent else NO_RETRY
        return await retrying(f"tinker {what}", attempt, policy)

    # -- sampling -----------------------------------------------------------------------------

    def token_sampler(self) -> TokenSampler:
        return self  # `sample` picks the newest version's client per request

    def _publish(self, client: tinker.SamplingClient, *, version: int) -> None:
        # One attribute, replaced whole: a request reads the pair once when it starts.
        self._sampler = (client, version)

    async def _new_sampling_client(self) -> tinker.SamplingClient:
        return await self._remote(
            "save_weights_and_get_sampling_client",
            self.training.save_weights_and_get_sampling_client,
        )

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        """One completion from the newest version's client (kept even if a sync happens)."""
        client, version = self._sampler
        wire = tinker.SamplingParams(
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop=params.stop or None,
            temperature=params.temperature,
            top_p=params.top_p,
        )
        prompt = tinker.ModelInput.from_ints(prompt_ids)
        response = await self._remote(
            "sample",
            lambda: client.sample(prompt, num_samples=1, sampling_params=wire),
            idempotent=True,
        )
        seq = response.sequences[0]
        tokens = [int(t) for t in seq.tokens]
        logprobs = [min(0.0, float(lp)) for lp in (seq.logprobs or [])]
        if len(logprobs) != len(tokens):
            raise BackendError(
                f"tinker sample returned {len(logprobs)} logprobs, {len(tokens)} tokens"
            )
        return ModelOutput(
            text=self._text(tokens, params.stop),
            prompt_ids=list(prompt_ids),
            completion_ids=tokens,
            logprobs=logprobs,
            finish_reason="length" if seq.stop_reason == "length" else "stop",
            policy_version=version,
            temperature=params.temperature,
        )

    def _text(self, tokens: list[int], stop: list[str]) -> str:
        specials = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        text: str = self.tokenizer.decode([t for t in tokens if t not in specials])
        for s in stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text

    async def on_policy_updated(self, version: int) -> None:
        self._publish(await self._new_sampling_client(), version=version)

    # -- training -----------------------------------------------------------------------------

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def set_entropy_coef(self, coef: float) -> None:
        self.entropy_coef = coef

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        loss = self.config.trainer.loss
        # Tinker's losses have no entropy term: the bonus folds into the advantages.
        sequences = sequences_of(
            groups,
            loss=loss,
            temperature=self.config.sampling.train.temperature,
            entropy_fold=self.entropy_coef if loss != "cross_entropy" else None,
        )
        if not sequences:
            return {}
        metrics: dict[str, float] = {}
        if self.reference is not None:
            metrics["train/kl_reference"] = await self._fold_kl(sequences)
        if loss != "cross_entropy":
            # Sampled at temperature 1: the mean -logprob estimates the policy's entropy.
            metrics["train/entropy"] = sampled_entropy(sequences)
        tokens = sum(seq.sampled_count for seq in sequences)
        scale = 1.0 / max(1, tokens) if self.config.trainer.loss_agg == "token_mean" else 1.0
        datums = [to_datum(seq, loss, scale) for seq in sequences]
        loss_config = None
        if loss in ("ppo", "cispo"):
            clip = self.config.trainer.clip_ratio
            loss_config = {"clip_low_threshold": 1 - clip, "clip_high_threshold": 1 + clip}
        # Submitted now, awaited in optim_step: the server computes while groups generate.
        future = self.training.forward_backward(datums, loss, loss_config)  # type: ignore[arg-type]
        self._pending.append(_Pending(future=future, sequences=sequences))
        return metrics

    async def _fold_kl(self, sequences: list[TrainingSequence]) -> float:
        """Score `sequences` under the reference in one `forward`; fold the penalty in."""
        reference = self.reference
        assert reference is not None
        datums = [to_datum(seq, "cross_entropy") for seq in sequences]
        output = await self._remote(
            "forward (KL reference)",
            lambda: reference.forward(datums, "cross_entropy"),  # type: ignore[arg-type]
            idempotent=True,
        )
        # Position i scores token i + 1; the first token has no logprob.
        scored: list[list[float | None]] = [
            [None, *row["logprobs"].to_numpy().tolist()] for row in output.loss_fn_outputs
        ]
        return fold_kl_penalty(sequences, scored, self.config.trainer.kl_coef)

    async def optim_step(self) -> dict[str, float]:
        pending, self._pending = self._pending, []
        optimizer = self.config.trainer.optimizer
        adam = tinker.AdamParams(
            learning_rate=self.lr,
            beta1=optimizer.betas[0],
            beta2=optimizer.betas[1],
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            grad_clip_norm=optimizer.max_grad_norm or 0.0,  # Tinker's 0: no clipping
        )
        step = self.training.optim_step(adam)

        async def together() -> tuple[list[Any], Any]:
            outputs = [await p.future for p in pending]
            return outputs, await step

        outputs, result = await self._remote("forward_backward + optim_step", together)
        metrics = _train_metrics(pending, outputs)
        if result.metrics and "grad_norm" in result.metrics:
            metrics["train/grad_norm"] = float(result.metrics["grad_norm"])
        return metrics

    # -- checkpoints --------------------------------------------------------------------------

    async def save_checkpoint(self, directory: Path) -> None:
        name = f"{self.config.name}-{directory.name}-{uuid.uuid4().hex[:8]}"
        saved = await self._remote("save_state", lambda: self.training.save_state(name))
        record = {
            "state_path": saved.path,
            "sampler_version": self._sampler[1],
            "base_model": self.base_model,
            "lora_rank": self.settings.lora_rank,
        }
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(
            (directory / "tinker.json").write_text, json.dumps(record, indent=2)
        )

    async def load_checkpoint(self, directory: Path) -> None:
        path = directory / "tinker.json"
        if not path.is_file():
            raise UsageError(f"{directory} holds no tinker checkpoint (tinker.json)")
        record = json.loads(await asyncio.to_thread(path.read_text))
        service = self._service
        assert service is not None
        training = await self._remote(
            "create_training_client_from_state_with_optimizer",
            lambda: service.create_training_client_from_state_with_optimizer(record["state_path"]),
            blocking=True,  # on a resume without a KL reference, the session's first call
        )
        self._load_next = False
        # The sampler restarts from the restored weights, at the version the run had synced.
        await self._use_policy(training, version=int(record["sampler_version"]))

    def set_outcome(self, status: RunStatus, detail: str | None = None) -> None:
        self._outcome = (status, detail)

    async def shutdown(self) -> None:
        try:
            if self._service is not None:
                service, self._service = self._service, None
                status, detail = self._outcome
                await self._remote("close", lambda: service.close(status, detail))
        finally:
            if self._server is not None:
                server, self._server = self._server, None
                await server.stop()


def _lora_shape(settings: TinkerConfig) -> dict[str, Any]:
    """`create_lora_training_client`'s adapter arguments from the `tinker:` section."""
    return {
        "rank": settings.lora_rank,
        "seed": settings.lora_seed,
        "train_attn": settings.train_attn,
        "train_mlp": settings.train_mlp,
        "train_unembed": settings.train_unembed,
    }


def _train_metrics(pending: list[_Pending], outputs: list[Any]) -> dict[str, float]:
    """Loss, KL(sampler || trainer) and the mean importance ratio over sampled tokens."""
    loss = sum(float(out.metrics.get("loss:sum", 0.0)) for out in outputs)
    gaps: list[np.ndarray] = []
    for batch, out in zip(pending, outputs, strict=True):
        for seq, row in zip(batch.sequences, out.loss_fn_outputs, strict=True):
            trainer = row["logprobs"].to_numpy()
            mask = np.asarray(seq.mask[1:], dtype=bool)
            sampler = np.asarray(seq.logprobs[1:], dtype=np.float64)
            gaps.append(sampler[mask] - trainer[mask])
    gap = np.concatenate(gaps) if gaps else np.zeros(0)
    return {
        "train/loss": loss,
        "train/kl_sample_train": float(gap.mean()) if gap.size else 0.0,
        "train/ratio_mean": float(np.exp(-gap).mean()) if gap.size else 0.0,
    }

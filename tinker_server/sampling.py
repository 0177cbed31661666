"""Sampling sessions of the local Tinker server: weight snapshots, each sampled by an engine.

A sampling session samples from one fixed snapshot of weights (the base model, or a training
model's weights with its adapters merged at the moment the session was made), so a training
step never changes what a running session samples: a new policy version is a new session.
The pool keeps the newest `keep` snapshots; a request to an evicted one is a clear user error.
What samples a snapshot is the server's engine (`SnapshotEngine`, `tinker-serve --engine`): the
built-in one here gives each snapshot its own `BatchingSampler` (concurrent requests of one
session share batches); vLLM's (`vllm_sampling.py`) loads the snapshot being sampled into one
engine. Invariant: a session's samples and prompt logprobs come from its snapshot's weights.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tinker_server.training import UserError
from tinker_server.wire import SampledTokens
from torchkit.sampler import BatchingSampler
from unified.errors import UsageError, first_cause
from unified.types import ModelOutput, SamplingParams

__all__ = [
    "BuiltinEngine",
    "SamplerPool",
    "Scored",
    "SnapshotEngine",
    "SnapshotSampler",
    "TopK",
    "sampling_params_from_wire",
]

BASE = "base"


def sampling_params_from_wire(
    wire: dict[str, Any], tokenizer: PreTrainedTokenizerBase, room: int | None
) -> SamplingParams:
    """`unified.types.SamplingParams` from Tinker's JSON sampling params.

    Stop tokens become their text (the sampler matches stop strings; EOS always stops);
    `max_tokens: null` means as many as the model's positions leave (`room`).
    """
    top_k = wire.get("top_k", -1)
    if top_k not in (-1, 0, None):
        raise UserError(f"sampling_params.top_k={top_k} is not supported by the local server")
    stop = wire.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    else:
        stops = [s if isinstance(s, str) else tokenizer.decode([int(s)]) for s in stop]
    max_tokens = wire.get("max_tokens") or room
    if max_tokens is None:
        raise UserError("sampling_params.max_tokens is required for this model")
    try:
        return SamplingParams(
            temperature=float(wire.get("temperature", 1.0)),
            top_p=float(wire.get("top_p", 1.0)),
            max_tokens=int(max_tokens),
            stop=stops,
            seed=wire.get("seed"),
        )
    except ValueError as e:
        raise UserError(f"invalid sampling_params: {e}") from e


class SnapshotSampler(Protocol):
    """Samples and scores one snapshot's weights; what the pool keeps per snapshot."""

    async def sample(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> list[ModelOutput]:
        """One completion of `prompt_ids` per entry of `params`, all in flight together."""
        ...

    async def score(self, prompt_ids: list[int], k: int) -> Scored:
        """The prompt's logprobs and, with `k` > 0, its top-k next tokens per position."""
        ...


class SnapshotEngine(Protocol):
    """What samples the server's snapshots: the built-in sampler, or vLLM."""

    @property
    def max_positions(self) -> int | None:
        """Most tokens (prompt + completion) one request may use."""
        ...

    def snapshot(self, weights: dict[str, torch.Tensor] | None) -> SnapshotSampler:
        """A sampler of `weights` (None: the base model); blocking."""
        ...

    def close(self) -> None:
        """Free the engine (its processes, files)."""
        ...


class BuiltinEngine:
    """The built-in engine: a `BatchingSampler` (its own copy of the model) per snapshot."""

    def __init__(
        self, template: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_batch: int
    ) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.max_batch = max_batch

    @property
    def max_positions(self) -> int | None:
        return getattr(self.template.config, "max_position_embeddings", None)

    def snapshot(self, weights: dict[str, torch.Tensor] | None) -> SnapshotSampler:
        sampler = BatchingSampler(self.template, self.tokenizer, max_batch=self.max_batch)
        if weights is not None:
            sampler.load_weights(weights, 0)
        return _BuiltinSnapshot(sampler)

    def close(self) -> None:
        pass


class _BuiltinSnapshot:
    def __init__(self, sampler: BatchingSampler) -> None:
        self.sampler = sampler
        self._scorer: _PromptScorer | None = None

    async def sample(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> list[ModelOutput]:
        return list(await asyncio.gather(*[self.sampler.sample(prompt_ids, p) for p in params]))

    async def score(self, prompt_ids: list[int], k: int) -> Scored:
        if self._scorer is None:
            self._scorer = _PromptScorer(self.sampler.model)
        return await self._scorer.score(prompt_ids, k)


class SamplerPool:
    """The server's sampling sessions: id -> snapshot -> the engine's sampler of it."""

    def __init__(
        self, engine: SnapshotEngine, tokenizer: PreTrainedTokenizerBase, *, keep: int = 8
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.keep = keep
        self._samplers: OrderedDict[str, SnapshotSampler] = OrderedDict()
        self._snapshot_of: dict[str, str] = {}
        self._owner: dict[str, str | None] = {}  # snapshot -> the training model that made it
        self._lock = threading.Lock()  # snapshots are added from worker threads

    @property
    def max_positions(self) -> int | None:
        """Most tokens (prompt + completion) one request may use."""
        return self.engine.max_positions

    def add_base(self, session_id: str) -> None:
        """Make `session_id` sample from the base model (blocking the first time)."""
        base = None
        if BASE not in self._samplers:
            base = self.engine.snapshot(None)
        with self._lock:  # snapshots are added from other worker threads
            if base is not None and BASE not in self._samplers:
                self._samplers[BASE] = base
            self._snapshot_of[session_id] = BASE

    def add_snapshot(
        self, session_id: str, weights: dict[str, torch.Tensor], owner: str | None = None
    ) -> None:
        """Make `session_id` sample from `weights` (blocking: the engine prepares them).

        The newest `keep` snapshots of each `owner` (a training model; None: loaded from a path)
        are kept: one run's syncs never expire another run's samplers.
        """
        sampler = self.engine.snapshot(weights)
        with self._lock:
            self._samplers[session_id] = sampler
            self._snapshot_of[session_id] = session_id
            self._owner[session_id] = owner
            mine = [key for key in self._samplers if key != BASE and self._owner[key] == owner]
            self._drop(mine[: max(0, len(mine) - self.keep)])

    def drop_owned(self, owners: Callable[[str], bool]) -> None:
        """Free the snapshots of the training models `owners` accepts (their session ended)."""
        with self._lock:
            self._drop([key for key, owner in self._owner.items() if owner and owners(owner)])

    def _drop(self, snapshots: list[str]) -> None:
        for old in snapshots:
            del self._samplers[old]
            self._owner.pop(old, None)

    def close(self) -> None:
        """Free the engine."""
        self.engine.close()

    def _sampler(self, session_id: str) -> SnapshotSampler:
        snapshot = self._snapshot_of.get(session_id)
        if snapshot is None:
            raise UserError(f"unknown sampling session {session_id!r}")
        sampler = self._samplers.get(snapshot)
        if sampler is None:
            raise UserError(
                f"sampling session {session_id!r} expired: the local server keeps the newest "
                f"{self.keep} weight snapshots of each training model, while its session lasts "
                "(tinker-serve --keep-samplers)"
            )
        return sampler

    async def sample(
        self,
        session_id: str,
        prompt_ids: list[int],
        num_samples: int,
        wire_params: dict[str, Any],
        *,
        prompt_logprobs: bool = False,
        topk_prompt: int = 0,
    ) -> tuple[list[SampledTokens], list[float] | None, TopK | None]:
        """`num_samples` completions of `prompt_ids` (batched with concurrent requests), and
        if asked the prompt's logprobs and its `topk_prompt` most likely tokens per position."""
        sampler = self._sampler(session_id)
        room = None if self.max_positions is None else self.max_positions - len(prompt_ids)
        params = sampling_params_from_wire(wire_params, self.tokenizer, room)
        if num_samples < 1:
            raise UserError(f"num_samples must be >= 1, got {num_samples}")

        def nth(i: int) -> SamplingParams:
            seed = None if params.seed is None else params.seed + i
            return params.model_copy(update={"seed": seed})

        scored = topk = None
        try:
            # Together: on one engine both join the same turn of this snapshot, and a refused
            # top-k ends the request before its samples are generated.
            async with asyncio.TaskGroup() as group:
                sampling = group.create_task(
                    sampler.sample(prompt_ids, [nth(i) for i in range(num_samples)])
                )
                if prompt_logprobs or topk_prompt:
                    scoring = group.create_task(sampler.score(prompt_ids, topk_prompt))
        except BaseExceptionGroup as errors:
            cause = first_cause(errors)
            if isinstance(cause, UsageError):  # the engine's checks: prompt, top-k too large
                raise UserError(str(cause)) from cause
            raise cause from None
        outputs = sampling.result()
        if prompt_logprobs or topk_prompt:
            scored, topk = scoring.result()
        sequences = [
            SampledTokens(
                tokens=o.completion_ids,
                logprobs=o.logprobs,
                stop_reason="length" if o.finish_reason == "length" else "stop",
            )
            for o in outputs
        ]
        return sequences, scored if prompt_logprobs else None, topk


class _PromptScorer:
    """Prompt logprobs (`compute_logprobs`), concurrent requests scored in one forward pass."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._waiting: list[_Scoring] = []
        self._running: asyncio.Future[None] | None = None

    async def score(self, prompt_ids: list[int], k: int = 0) -> Scored:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Scored] = loop.create_future()
        self._waiting.append((prompt_ids, k, future))
        await asyncio.sleep(0)  # requests of the same tick join one batch
        while not future.done():
            if self._running is None or self._running.done():
                batch, self._waiting = self._waiting, []
                self._running = loop.run_in_executor(None, _score_batch, self.model, batch)
            await asyncio.wait([future, self._running], return_when=asyncio.FIRST_COMPLETED)
        return future.result()


TopK = tuple[np.ndarray, np.ndarray]
"""Top-k prompt logprobs: token ids (int32) and logprobs (float32), each `(prompt length, k)`;
position 0 (nothing precedes it) holds the SDK's sentinel, token 0 with `MASK_LOGPROB`."""
MASK_LOGPROB = -99999.0
Scored = tuple[list[float], TopK | None]
"""A prompt's logprobs (NaN first: nothing precedes it) and, if asked, its top-k (`TopK`)."""
_Scoring = tuple[list[int], int, asyncio.Future[Scored]]


@torch.no_grad()
def _score_batch(model: PreTrainedModel, batch: list[_Scoring]) -> None:
    """Logprob of each prompt token given the ones before it (NaN for the first), and the
    top-k next tokens at each position where k > 0, per request."""
    results: list[Scored | BaseException]
    try:
        width = max(len(ids) for ids, _, _ in batch)
        device = next(model.parameters()).device
        ids_BL = torch.zeros(len(batch), width, dtype=torch.long)
        mask_BL = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (ids, _, _) in enumerate(batch):
            ids_BL[b, : len(ids)], mask_BL[b, : len(ids)] = torch.tensor(ids), 1
        ids_BL, mask_BL = ids_BL.to(device), mask_BL.to(device)
        logits = model(input_ids=ids_BL, attention_mask=mask_BL).logits[:, :-1].float()
        logp_BLV = torch.log_softmax(logits, dim=-1)
        picked_BL = logp_BLV.gather(2, ids_BL[:, 1:, None])[..., 0]
        results = []
        for b, (ids, k, _) in enumerate(batch):
            topk = None
            if k > 0:
                n = len(ids)
                top_ids = np.zeros((n, k), dtype=np.int32)
                top_lps = np.full((n, k), MASK_LOGPROB, dtype=np.float32)
                best = logp_BLV[b, : n - 1].topk(min(k, logp_BLV.shape[-1]), dim=-1)
                top_ids[1:, : best.indices.shape[1]] = best.indices.cpu().numpy()
                top_lps[1:, : best.values.shape[1]] = best.values.cpu().numpy()
                topk = (top_ids, top_lps)
            results.append(([float("nan"), *picked_BL[b, : len(ids) - 1].tolist()], topk))
    except Exception as e:
        results = [e] * len(batch)
    for (_, _, future), result in zip(batch, results, strict=True):
        loop = future.get_loop()
        if isinstance(result, BaseException):
            loop.call_soon_threadsafe(_fail, future, result)
        else:
            loop.call_soon_threadsafe(_resolve, future, result)


def _resolve(future: asyncio.Future[Scored], result: Scored) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[Scored], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

"""vLLM behind the local Tinker server's sampling sessions (`tinker-serve --engine vllm`).

vLLM holds one set of weights per engine while every sampling session samples its own snapshot,
so one engine serves them all in turns: the requests of one snapshot run together (vLLM's
continuous batching), and when the next turn is another snapshot's, the engine is reloaded in
place with its weights (`VllmSampler.load_weights`, the shared-memory sync) once the running
turn has ended. Turns are first come, first served, one queued per snapshot: a request joins
the running turn only while no request for another snapshot waits, else its snapshot's queued
turn (a new one at the back if none), so no snapshot starves and requests that alternate
between snapshots cost a reload per turn, not per request.
Invariant: a request runs only while its snapshot's weights are loaded; every output carries
the engine's version, which is the snapshot's own number, and is checked.

The cost: one reload per change of snapshot between turns, requests of different snapshots
never batched together, and each snapshot's merged weights kept in CPU memory (the built-in
engine keeps a model copy per snapshot: the same memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import tempfile
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tinker_server.sampling import MASK_LOGPROB, Scored, SnapshotSampler, TopK
from torchkit.builtin import save_policy
from torchkit.vllm_engine import PromptLogprobs, VllmSampler
from torchkit.vllm_settings import VllmSettings
from unified.errors import BackendError, first_cause
from unified.types import ModelOutput, SamplingParams

__all__ = ["VllmEngine"]

_BASE_VERSION = 0


class VllmEngine:
    """One vLLM engine for every snapshot of the server (a `sampling.SnapshotEngine`)."""

    def __init__(self, sampler: VllmSampler, base: dict[str, torch.Tensor], workdir: Path) -> None:
        self.sampler = sampler
        self._base = base
        self._workdir = workdir
        self._numbers = itertools.count(_BASE_VERSION + 1)
        self._turns = _Turns(sampler)

    @classmethod
    def start(
        cls,
        template: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        settings: VllmSettings,
        *,
        key: str = "--vllm",
    ) -> VllmEngine:
        """Start an engine on `template` (the base model, its output layer untied so merged
        unembedding adapters load), written to a scratch directory vLLM loads. A bad setting
        is a one-line `ConfigError` naming `key`."""
        workdir = Path(tempfile.mkdtemp(prefix="unified-tinker-vllm-"))
        try:
            save_policy(template, tokenizer, workdir / "base")
            sampler = VllmSampler.start(
                workdir / "base", settings, tokenizer=tokenizer, key=key, cleanup=[workdir]
            )
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(sampler, template.state_dict(), workdir)

    @property
    def max_positions(self) -> int | None:
        return self.sampler.max_model_len

    @property
    def reloads(self) -> int:
        """How many times a turn loaded its snapshot into the engine."""
        return self._turns.reloads

    def snapshot(self, weights: dict[str, torch.Tensor] | None) -> SnapshotSampler:
        if weights is None:  # the engine starts on the base weights
            return _VllmSnapshot(self._turns, _BASE_VERSION, self._base)
        return _VllmSnapshot(self._turns, next(self._numbers), weights)

    async def warm_up(self) -> None:
        """The engine's first reload, at start (`VllmSampler.warm_up`)."""
        await self.sampler.warm_up()

    def close(self) -> None:
        self.sampler.shutdown()
        shutil.rmtree(self._workdir, ignore_errors=True)


class _VllmSnapshot:
    """One snapshot's weights (kept on the CPU) and its number, the engine's version while
    they are loaded."""

    def __init__(self, turns: _Turns, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.turns = turns
        self.version = version
        self.weights = weights

    async def sample(
        self, prompt_ids: list[int], params: list[SamplingParams]
    ) -> list[ModelOutput]:
        sampler = self.turns.sampler
        async with self.turns.turn(self.version, self.weights):
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(sampler.sample(prompt_ids, p)) for p in params]
            except BaseExceptionGroup as errors:
                raise first_cause(errors) from None
        outputs = [task.result() for task in tasks]
        for output in outputs:
            self._check(output.policy_version)
        return outputs

    async def score(self, prompt_ids: list[int], k: int) -> Scored:
        async with self.turns.turn(self.version, self.weights):
            scores = await self.turns.sampler.score_prompt(prompt_ids, k)
        self._check(scores.version)
        return scores.logprobs, _topk(scores, k) if k > 0 else None

    def _check(self, version: int) -> None:
        if version != self.version:
            raise BackendError(
                f"vLLM answered with the weights of snapshot {version}, not {self.version}"
            )


def _topk(scores: PromptLogprobs, k: int) -> TopK:
    """The built-in scorer's layout: `(positions, k)` ids and logprobs, masked where empty."""
    ids = np.zeros((len(scores.top), k), dtype=np.int32)
    logprobs = np.full((len(scores.top), k), MASK_LOGPROB, dtype=np.float32)
    for position, ranked in enumerate(scores.top):
        for rank, (token, logprob) in enumerate(ranked[:k]):
            ids[position, rank], logprobs[position, rank] = token, logprob
    return ids, logprobs


@dataclass(eq=False)
class _Turn:
    """Requests for one snapshot that use the engine together."""

    version: int
    weights: dict[str, torch.Tensor]
    waiting: int = 0
    running: int = 0


class _Turns:
    """Who uses the engine: one snapshot's requests at a time, turns first come first served.

    The head turn runs once its snapshot is loaded; its first waiter loads it, which happens
    only after the turn before it has ended (a turn leaves the queue when no request of it
    waits or runs), so a reload never overlaps a request of another snapshot.
    """

    def __init__(self, sampler: VllmSampler) -> None:
        self.sampler = sampler
        self._loaded: int | None = _BASE_VERSION  # None: unknown (a load failed part-way)
        self.reloads = 0
        self._queue: deque[_Turn] = deque()
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def turn(self, version: int, weights: dict[str, torch.Tensor]) -> AsyncIterator[None]:
        """Hold the engine with snapshot `version` loaded (`weights`) for one request."""
        async with self._changed:
            turn = self._join(version, weights)
            turn.waiting += 1
            try:
                while not (self._queue[0] is turn and self._loaded == version):
                    if self._queue[0] is turn:  # nothing runs: load this turn's snapshot
                        self._loaded = None
                        await self.sampler.load_weights(weights, version)
                        self._loaded = version
                        self.reloads += 1
                    else:
                        await self._changed.wait()
            except BaseException:  # e.g. a failed load: the turn's other requests try again
                turn.waiting -= 1
                self._leave(turn)
                self._changed.notify_all()
                raise
            turn.waiting -= 1
            turn.running += 1
        try:
            yield
        finally:
            async with self._changed:
                turn.running -= 1
                self._leave(turn)

    def _join(self, version: int, weights: dict[str, torch.Tensor]) -> _Turn:
        """The turn a new request for `version` takes: the running one while no other waits,
        else the one queued for `version`, else a new one at the back. So each snapshot has at
        most one turn queued, and a queued turn waits for at most one turn per other snapshot."""
        for index, turn in enumerate(self._queue):
            if turn.version == version and (index > 0 or len(self._queue) == 1):
                return turn
        turn = _Turn(version, weights)
        self._queue.append(turn)
        return turn

    def _leave(self, turn: _Turn) -> None:
        if turn.waiting == 0 and turn.running == 0:
            self._queue.remove(turn)
            self._changed.notify_all()

"""A simulated inference engine for `bench.pipeline --sampler`: the latency sits in the sampler.

Each request waits for one of `slots` engine slots, then decodes `L` tokens at `token_s` seconds
a token (lognormal `L`, capped at `max_tokens`): what a continuous-batching engine does when
its step time barely depends on how many slots are busy. Each token is stamped with the policy
version visible when it was decoded (in flight across a weight sync, as vLLM's keep-the-KV pause
or the built-in sampler's partial rollouts), or, without partial rollouts, with the version the
request started on (it finishes on its snapshot, as the tinker backend's requests do).

The engine keeps its own books, independent of the trainer's metrics: every token it decoded
(those of cancelled requests too), the length drawn for every request made (the data's length
distribution, which a loop that cuts long requests trains below), its slots' busy time, and the
lag of every token trained (trainer version at `forward_backward` minus the token's version).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import cast

from unified.metrics import counted_quantile
from unified.protocol import BackendCapabilities
from unified.testing import END_OF_ANSWER, BanditBackend, BanditSampler, softmax
from unified.types import ModelOutput, SamplingParams, TrajectoryGroup


@dataclass(frozen=True)
class EngineWorkload:
    """A workload whose time is the engine's: `batch` groups of `group` requests a step."""

    name: str
    train_s: float  # training time per step
    sigma: float = 1.0  # of the lognormal completion length
    max_staleness: int = 1
    batch: int = 8
    group: int = 8
    median_tokens: int = 32
    max_tokens: int = 1024
    token_s: float = 0.001  # decode time of one token in one slot
    slots: int = 32

    def length(self, rng: random.Random) -> int:
        drawn = self.median_tokens * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return max(1, min(self.max_tokens, round(drawn)))

    def generation_s(self, samples: int = 50_000) -> float:
        """Decode time of one step's batch on all slots: the generation half of the bound."""
        rng = random.Random(12345)
        mean = sum(self.length(rng) for _ in range(samples)) / samples
        return self.batch * self.group * mean * self.token_s / self.slots


def engine_workloads(staleness: tuple[int, ...] = (1, 2)) -> list[EngineWorkload]:
    """Training-bound (generation a third of a step) and generation-bound (1.3x training),
    at sigma 1.0 and 1.5, for each `max_staleness`."""
    out = []
    for s in staleness:
        for sigma in (1.0, 1.5):
            gen_s = EngineWorkload("", 0.0, sigma=sigma).generation_s()
            for regime, train_s in (
                ("training_bound", 3 * gen_s),
                ("generation_bound", gen_s / 1.3),
            ):
                name = f"engine_{regime}_sigma{sigma:g}_s{s}"
                out.append(EngineWorkload(name, train_s, sigma=sigma, max_staleness=s))
    return out


class EngineSampler(BanditSampler):
    """The bandit's answer as the first token, then filler tokens decoded at the engine's pace."""

    def __init__(self, backend: EngineBackend) -> None:
        super().__init__(backend)
        self.engine = backend

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        e, w = self.engine, self.engine.w
        seed = cast(int, params.seed)
        length = w.length(random.Random(seed ^ 0x1E46))  # independent of the answer's draw
        e.requested_lengths.append(length)
        async with e.slots:
            started = time.monotonic()
            version, logits = e.sampler_version, list(e.sampler_logits)
            probs = softmax(logits, params.temperature or 1.0)
            answer = random.Random(seed).choices(range(len(probs)), probs)[0]
            decoded = 0
            try:
                await asyncio.sleep(length * w.token_s)
                decoded = length
            finally:
                elapsed = time.monotonic() - started
                e.busy_s += elapsed
                e.decoded += decoded or min(length, int(elapsed / w.token_s))
        if e.partial_rollout:  # each token under the version visible when it was decoded
            versions = [e.version_at(started + (i + 1) * w.token_s) for i in range(length)]
        else:
            versions = [version] * length
        return ModelOutput(
            text=str(answer),
            prompt_ids=prompt_ids,
            completion_ids=[48 + answer] + [END_OF_ANSWER] * (length - 1),
            logprobs=[math.log(softmax(logits)[answer])] + [0.0] * (length - 1),
            finish_reason="stop",
            policy_version=version,
            token_versions=versions if e.partial_rollout else None,
        )


class EngineBackend(BanditBackend):
    """The bandit behind a simulated engine, with a blocking training cost per step."""

    def __init__(self, w: EngineWorkload) -> None:
        super().__init__(capabilities=BackendCapabilities(partial_rollout=True))
        self.w = w
        self.slots = asyncio.Semaphore(w.slots)
        self.syncs: list[tuple[float, int]] = [(-math.inf, 0)]
        self.busy_s = 0.0
        self.decoded = 0  # every token decoded, cancelled requests' too
        # The length of every request made, finished or cut: the data's length distribution.
        self.requested_lengths: list[int] = []
        self.trained_lags: Counter[int] = Counter()
        self.trained_lengths: list[int] = []
        self.step_times: list[float] = []

    def token_sampler(self) -> EngineSampler:
        return EngineSampler(self)

    def version_at(self, t: float) -> int:
        """The sampler's version at monotonic time `t` (now, at the latest)."""
        index = bisect.bisect_right(self.syncs, t, key=lambda sync: sync[0]) - 1
        return self.syncs[index][1]

    async def on_policy_updated(self, version: int) -> None:
        await super().on_policy_updated(version)
        self.syncs.append((time.monotonic(), version))

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        for group in groups:
            for episode in group.episodes:
                for trajectory in episode.trajectories:
                    for step in trajectory.steps:
                        out = step.output
                        self.trained_lengths.append(len(out.completion_ids))
                        for v in out.token_versions or [out.policy_version] * len(
                            out.completion_ids
                        ):
                            self.trained_lags[self.sampler_version - v] += 1
        await asyncio.to_thread(time.sleep, self.w.train_s * len(groups) / self.w.batch)
        return await super().forward_backward(groups)

    async def optim_step(self) -> dict[str, float]:
        self.step_times.append(time.perf_counter())
        return await super().optim_step()

    def lag(self, quantile: float) -> float:
        """The smallest token lag that `quantile` of the trained tokens do not exceed."""
        return float(counted_quantile(self.trained_lags, quantile))

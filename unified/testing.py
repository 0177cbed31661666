"""Fakes for checking a setup without a model: a deterministic in-memory bandit backend, its
workflow and tasks, a toy workflow for real-model backends, and fault injectors.

Use them to check a workflow, a config or the trainer's failure settings in seconds, on any
machine (`backend: unified.testing:BanditBackend`, `workflow: unified.testing:BanditWorkflow`,
`data.train: {generator: "unified.testing:bandit_tasks", n: 64}`); the test suite and the
benchmarks are built on them.

The bandit backend is a softmax bandit small enough to reason about. The "policy" is a logit per
answer 0..K-1; a request's answer is drawn from softmax(logits / temperature) with the request's
seed, so outputs depend only on the seed and the weights version, never on timing. Training is
plain policy gradient on those logits, with a separate sampler copy of the weights that only
`on_policy_updated` refreshes (so async data is really off-policy). With
`async.partial_rollout: true` (and the capability) a request samples its answer, waits again,
then ends with an end-of-answer token under whatever version is current by then, recording both
tokens' versions: a request that spans a weight sync, as the local backend's partial rollouts
do. Every call is recorded for inspection (`requests`, `events`).

Fault injectors (`FlakyWorkflow`, `StuckOptimStep`) draw their faults from seeded generators, so
a run's faults are the same on every run.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

from unified.config import TrainerConfig
from unified.protocol import BackendCapabilities, BackendProtocol, RolloutEngine
from unified.types import ModelOutput, SamplingParams, Step, Task, Trajectory, TrajectoryGroup


class CharTokenizer:
    """Code points as token ids; its chat template is the messages' contents, concatenated."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, tokenize: bool = True, **_: Any
    ) -> list[int] | str:
        text = "".join(str(m["content"]) for m in conversation)
        return self.encode(text) if tokenize else text


def softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    total = sum(exps)
    return [e / total for e in exps]


END_OF_ANSWER = ord(".")


class BanditSampler:
    """Samples an answer digit from the sampler copy of the logits (the bandit's `TokenSampler`)."""

    def __init__(self, backend: BanditBackend) -> None:
        self.backend = backend

    @property
    def tokenizer(self) -> CharTokenizer:
        return self.backend.tokenizer

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        b = self.backend
        seed, temperature = cast(int, params.seed), params.temperature  # the core sets seeds
        b.requests.append({**params.model_dump(), "version": b.sampler_version})
        b.active_requests += 1
        try:
            await b.latency(seed)
            version, logits = b.sampler_version, list(b.sampler_logits)
            if temperature == 0:
                answer = max(range(len(logits)), key=lambda i: logits[i])
            else:
                probs = softmax(logits, temperature)
                answer = random.Random(seed).choices(range(len(probs)), probs)[0]
            logprob = math.log(softmax(logits)[answer])
            if not b.partial_rollout:
                return ModelOutput(
                    text=str(answer),
                    prompt_ids=prompt_ids,
                    completion_ids=[48 + answer],
                    logprobs=[logprob],
                    finish_reason="stop",
                    policy_version=version,
                )
            await b.end_latency(seed + 1)
            return ModelOutput(
                text=str(answer),
                prompt_ids=prompt_ids,
                completion_ids=[48 + answer, END_OF_ANSWER],
                logprobs=[logprob, 0.0],  # the end token is certain under every version
                finish_reason="stop",
                policy_version=version,
                token_versions=[version, b.sampler_version],
            )
        finally:
            b.active_requests -= 1


async def no_latency(seed: int) -> None:
    await asyncio.sleep(0)


def heavy_tailed_latency(scale_yields: float = 2.0, cap: int = 200) -> Callable[[int], Any]:
    """Latency as a Pareto-distributed number of event-loop yields, keyed on the seed."""

    async def latency(seed: int) -> None:
        yields = min(cap, int(scale_yields * random.Random(seed ^ 0x5EED).paretovariate(1.2)))
        for _ in range(yields):
            await asyncio.sleep(0)

    return latency


class BanditBackend(BackendProtocol):
    """Policy gradient on K logits; records every call."""

    name: ClassVar[str] = "bandit"
    capabilities = BackendCapabilities(adaptive_entropy=True)

    def __init__(
        self,
        arms: int = 4,
        *,
        latency: Callable[[int], Any] = no_latency,
        capabilities: BackendCapabilities | None = None,
        end_latency: Callable[[int], Any] | None = None,
    ) -> None:
        self.arms = arms
        self.tokenizer = CharTokenizer()
        self.latency = latency
        self.end_latency = end_latency or latency  # before a partial rollout's end token
        if capabilities is not None:
            self.capabilities = capabilities
        self.train_logits = [0.0] * arms
        self.sampler_logits = [0.0] * arms
        self.sampler_version = 0
        self.grad = [0.0] * arms
        self.lr = 0.0
        self.entropy_coef = 0.0
        self.requests: list[dict[str, Any]] = []
        self.events: list[tuple[Any, ...]] = []
        self.active_requests = 0
        self.workflows_running = 0
        self.setup_called = self.shutdown_called = False
        self.model: str | None = None
        self.partial_rollout = False

    async def setup(self, config: TrainerConfig) -> None:
        self.setup_called = True
        self.partial_rollout = bool(config.async_.partial_rollout)
        self.model = config.model
        self.lr = config.trainer.lr
        self.entropy_coef = config.trainer.entropy_coef

    def token_sampler(self) -> BanditSampler:
        return BanditSampler(self)

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.events.append(("forward_backward", [g.group_id for g in groups]))
        probs = softmax(self.train_logits)
        losses, kls = [], []
        for group in groups:
            for episode, advantage in zip(group.episodes, group.advantages, strict=True):
                for trajectory in episode.trajectories:
                    for step in trajectory.steps:
                        answer = step.output.completion_ids[0] - 48
                        for i in range(self.arms):
                            self.grad[i] += advantage * ((i == answer) - probs[i])
                        train_logprob = math.log(probs[answer])
                        losses.append(-advantage * train_logprob)
                        kls.append(step.output.logprobs[0] - train_logprob)
        # The entropy bonus, once per sampled token: dH/dz_i = -p_i (log p_i + H).
        entropy = -sum(p * math.log(p) for p in probs)
        for i, p in enumerate(probs):
            self.grad[i] -= self.entropy_coef * len(losses) * p * (math.log(p) + entropy)
        return {
            "train/loss": sum(losses) / max(1, len(losses)),
            "train/kl_sample_train": sum(kls) / max(1, len(kls)),
            "train/entropy": entropy,
        }

    async def optim_step(self) -> dict[str, float]:
        self.events.append(("optim_step", self.lr))
        self.train_logits = [
            w + self.lr * g for w, g in zip(self.train_logits, self.grad, strict=True)
        ]
        self.grad = [0.0] * self.arms
        return {"train/grad_norm": 0.0}

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr

    def set_entropy_coef(self, coef: float) -> None:
        self.events.append(("set_entropy_coef", coef))
        self.entropy_coef = coef

    async def on_policy_updated(self, version: int) -> None:
        self.events.append(
            ("on_policy_updated", version, self.workflows_running, self.active_requests)
        )
        self.sampler_logits = list(self.train_logits)
        self.sampler_version = version

    async def save_checkpoint(self, directory: Path) -> None:
        state = {
            "train": self.train_logits,
            "sampler": self.sampler_logits,
            "sampler_version": self.sampler_version,
            "grad": self.grad,
        }
        (directory / "bandit.json").write_text(json.dumps(state))

    async def load_checkpoint(self, directory: Path) -> None:
        state = json.loads((directory / "bandit.json").read_text())
        self.train_logits, self.sampler_logits = state["train"], state["sampler"]
        self.sampler_version = state["sampler_version"]
        self.grad = state["grad"]

    async def shutdown(self) -> None:
        self.shutdown_called = True


class BanditWorkflow:
    """Ask for the task's target answer; reward 1 for a hit. Tracks running workflows."""

    backend: ClassVar[BanditBackend | None] = None
    required_fields: ClassVar[tuple[str, ...]] = ("target",)

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        backend = model._engine.backend if hasattr(model, "_engine") else None
        if backend is not None:
            backend.workflows_running += 1
        try:
            messages = [{"role": "user", "content": f"pick {task.data['target']}"}]
            out = await model.chat(messages)
            reward = float(out.text == str(task.data["target"]))
            step = Step(messages=messages, output=out, reward=reward)
            return Trajectory(steps=[step], reward=reward)
        finally:
            if backend is not None:
                backend.workflows_running -= 1


def bandit_tasks(n: int, arms: int = 4, prefix: str = "t", target: int | None = None) -> list[Task]:
    """`n` tasks whose targets cycle through the arms, or all hit `target` (learnable)."""
    return [
        Task(id=f"{prefix}{i}", data={"target": i % arms if target is None else target})
        for i in range(n)
    ]


def multi_call_workflow(calls: int) -> Callable[[Task, RolloutEngine], Any]:
    """A workflow that calls the model `calls` times (one Step each); the last answer scores."""

    async def run(task: Task, model: RolloutEngine) -> Trajectory:
        steps = []
        for turn in range(calls):
            messages = [{"role": "user", "content": f"pick {task.data['target']} ({turn})"}]
            out = await model.chat(messages)
            steps.append(Step(messages=messages, output=out))
        reward = float(steps[-1].output.text == str(task.data["target"]))
        return Trajectory(steps=steps, reward=reward)

    return run


class DigitsWorkflow:
    """Reward = share of digits in the reply: a random built-in model climbs it in a few steps,
    so it checks a real-model backend end to end (`model: builtin:tiny`, `digits_tasks`)."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        messages = [{"role": "user", "content": task.data["prompt"]}]
        out = await model.chat(messages)
        reward = sum(c.isdigit() for c in out.text) / max(1, len(out.text))
        return Trajectory(steps=[Step(messages=messages, output=out, reward=reward)], reward=reward)


def digits_tasks(n: int = 64) -> list[Task]:
    """`n` prompts of digits for `DigitsWorkflow`."""
    return [Task(id=f"t{i}", data={"prompt": f"{i} {i + 3} -> {2 * i}"}) for i in range(n)]


def _draw(task: Task, model: RolloutEngine) -> float:
    seed = getattr(model, "_seed", None) or 0
    return random.Random(f"{task.id}/{seed}").random()


class FlakyWorkflow(BanditWorkflow):
    """The bandit workflow, but 10% of runs raise and 5% hang until their timeout: checks
    `trainer.max_error_rate` and `trainer.workflow_timeout_s`. Faults are keyed on the task and
    the request seed."""

    error_rate = 0.10
    hang_rate = 0.05

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        draw = _draw(task, model)
        if draw < self.error_rate:
            raise ConnectionError(f"injected workflow error on {task.id}")
        if draw < self.error_rate + self.hang_rate:
            await asyncio.Event().wait()  # never set: only the workflow timeout ends this
        return await super().run(task, model)


class StuckOptimStep(BanditBackend):
    """`optim_step` never returns (an awaited reply that never comes): checks
    `trainer.backend_timeout_s`."""

    async def optim_step(self) -> dict[str, float]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

"""Fakes for agent-workflow tests: a scripted engine, a guessing game, a tool-calling bandit.

Each is small enough to check by reading: the engine replies from a list, the game answers
"higher"/"lower", the bandit calls one tool before it picks an arm.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from backends.local.backend import LocalBackend
from torchkit.builtin import build_tokenizer
from unified.chat import chat_prompt_ids
from unified.config import load_config
from unified.protocol import RolloutEngine
from unified.sequences import TrainingSequence
from unified.testing import BanditBackend, BanditSampler
from unified.types import ModelOutput, SamplingParams, Task, TrajectoryGroup
from workflows.multi_turn import Observation
from workflows.tools import ToolWorkflow

LOOKUP_CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'


class ScriptedEngine(RolloutEngine):
    """Replies with the next of `replies`, tokenized by the built-in tokenizer and template.

    Completion ids end with `<|im_end|>` as the local sampler's do; every logprob is -1.
    """

    def __init__(self, replies: list[str]) -> None:
        self._tokenizer = build_tokenizer()
        self.replies = list(replies)
        self.prompts: list[list[dict[str, Any]]] = []
        self.sampling: list[dict[str, Any]] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def encode_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return chat_prompt_ids(
            self._tokenizer, messages, add_generation_prompt=add_generation_prompt
        )

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ModelOutput:
        self.prompts.append([dict(m) for m in messages])
        self.sampling.append(dict(sampling))
        return await self.complete(self.encode_chat(messages), **sampling)

    async def complete(self, prompt_ids: list[int], **sampling: Any) -> ModelOutput:
        text = self.replies.pop(0)
        completion = [*self._tokenizer.encode(text), self._tokenizer.eos_token_id]
        return ModelOutput(
            text=text,
            prompt_ids=prompt_ids,
            completion_ids=completion,
            logprobs=[-1.0] * len(completion),
            finish_reason="stop",
            policy_version=0,
        )


async def local_loss_rows(
    group: TrajectoryGroup,
) -> tuple[list[TrainingSequence], torch.Tensor, torch.nn.Module]:
    """What the local backend's loss scores for `group`: its sequences, their logprobs, the model.

    One `forward_backward` on a fresh `builtin:tiny` backend, with its scoring function spied on.
    """
    backend = LocalBackend()
    config = load_config(
        {"workflow": "tests.agents:LookupBanditWorkflow", "model": "builtin:tiny",
         "trainer": {"loss": "importance_sampling"}}
    )  # fmt: skip
    await backend.setup(config)
    scored: list[tuple[list[TrainingSequence], torch.Tensor]] = []
    score = backend._score

    def spy(model: torch.nn.Module, chunk: list[TrainingSequence], **kw: Any) -> Any:
        result = score(model, chunk, **kw)
        scored.append((chunk, result[0].detach()))
        return result

    backend._score = spy  # type: ignore[method-assign]
    try:
        await backend.forward_backward([group])
    finally:
        await backend.shutdown()
    ((chunk, logp_T),) = scored
    return chunk, logp_T, backend.model


class GuessingGame:
    """Guess `task.data["target"]`: "higher"/"lower" and -0.1 per wrong guess, +1 on a hit."""

    def __init__(self) -> None:
        self.target = 0

    async def reset(self, task: Task) -> Observation:
        self.target = int(task.data["target"])
        return "guess a number"

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        guess = int(action) if action.strip().isdigit() else -1
        if guess == self.target:
            return "", 1.0, True
        return ("higher" if guess < self.target else "lower"), -0.1, False


class ToolBanditSampler(BanditSampler):
    """Calls `lookup` until the prompt holds its call (a tool result follows it), then picks an
    arm as the bandit."""

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> ModelOutput:
        if LOOKUP_CALL in self.tokenizer.decode(prompt_ids):
            return await super().sample(prompt_ids, params)
        completion = self.tokenizer.encode(LOOKUP_CALL)
        return ModelOutput(
            text=LOOKUP_CALL,
            prompt_ids=prompt_ids,
            completion_ids=completion,
            logprobs=[math.log(0.9)] * len(completion),
            finish_reason="stop",
            policy_version=self.backend.sampler_version,
        )


class ToolBanditBackend(BanditBackend):
    """The bandit, trained on its answer steps only; records every step it was given."""

    name = "tool-bandit"

    def __init__(self) -> None:
        super().__init__()
        self.steps_seen: list[Any] = []

    def token_sampler(self) -> ToolBanditSampler:
        return ToolBanditSampler(self)

    async def forward_backward(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        self.steps_seen += [
            s for g in groups for e in g.episodes for t in e.trajectories for s in t.steps
        ]
        return await super().forward_backward([_answers_only(g) for g in groups])


def _answers_only(group: TrajectoryGroup) -> TrajectoryGroup:
    """A copy of `group` whose trajectories keep only their arm-picking (digit) steps."""
    episodes = [
        e.model_copy(
            update={
                "trajectories": [
                    t.model_copy(update={"steps": [s for s in t.steps if s.output.text.isdigit()]})
                    for t in e.trajectories
                ]
            }
        )
        for e in group.episodes
    ]
    return group.model_copy(update={"episodes": episodes})


def lookup() -> str:
    """Say which arm pays."""
    return "pick your target"


class LookupBanditWorkflow(ToolWorkflow):
    """Pick the task's target arm, after a `lookup` tool call; 1 for a hit."""

    tools = (lookup,)

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"pick {task.data['target']}"}]

    def reward(self, task: Task, answer: str) -> float:
        return float(answer == str(task.data["target"]))

"""`SingleTurnWorkflow`: one prompt, one reply, one reward — the shape of most RLVR tasks."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from unified.protocol import RolloutEngine
from unified.types import Step, Task, Trajectory
from workflows.base import Workflow

__all__ = ["SingleTurnWorkflow"]


class SingleTurnWorkflow(Workflow):
    """Subclass with `messages(task)` and `reward(task, reply)`; `run` does the rest.

    `reward` returns a float, or `(reward, correct)` so evaluation can count exact successes
    separately from shaped rewards.
    """

    @abstractmethod
    def messages(self, task: Task) -> list[dict[str, Any]]:
        """The conversation to send to the model."""

    @abstractmethod
    def reward(self, task: Task, reply: str) -> float | tuple[float, bool]:
        """Score the model's reply."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        messages = self.messages(task)
        output = await model.chat(messages)
        scored = self.reward(task, output.text)
        reward, correct = scored if isinstance(scored, tuple) else (scored, scored > 0)
        step = Step(messages=messages, output=output, reward=reward, info={"correct": correct})
        return Trajectory(steps=[step], reward=reward)

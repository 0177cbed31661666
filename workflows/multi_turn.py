"""`MultiTurnWorkflow`: the policy talks to an environment, turn by turn, until it is done.

Each turn is one `chat` call and one `Step`; the environment's per-turn reward is the step's
`reward`, and the trajectory's reward is their sum (the undiscounted return), which is what the
group's advantages are computed from. The conversation is one append-only `Transcript`: every
step keeps an O(1) snapshot of the prompt it saw, so an N-turn episode holds N messages, not
N^2/2. Only the model's replies train; observations are prompt tokens of later turns, never
targets of the loss (see docs/workflows.md, "Masking").
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from unified.errors import WorkflowError
from unified.protocol import RolloutEngine
from unified.types import Step, Task, Trajectory, Transcript
from workflows.base import Workflow

__all__ = ["Environment", "MultiTurnWorkflow", "Observation"]

Observation = str | Sequence[dict[str, Any]]
"""What an environment shows the model: text (one message of the observation role) or messages."""


@runtime_checkable
class Environment(Protocol):
    """An episode's world: `reset` opens it, `step` answers one model reply.

    Both are async so environments can await I/O; wrap blocking work in `asyncio.to_thread`.
    An exception is a bug of the environment: the episode is recorded as an error.
    """

    async def reset(self, task: Task) -> Observation:
        """Start an episode on `task`; return the first observation (the opening prompt)."""
        ...

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        """Apply the model's reply; return (observation, this turn's reward, done)."""
        ...


class MultiTurnWorkflow(Workflow):
    """Subclass with `environment(task)`; `run` alternates model replies and observations.

    `max_turns` bounds the model calls of an episode: an episode still going after it ends
    with `info["truncated"] = True` on its last step. A str observation becomes one message
    with role `observation_role`; `system_prompt`, if set, opens every conversation.
    """

    max_turns: int = 8
    observation_role: str = "user"
    system_prompt: str | None = None

    @abstractmethod
    def environment(self, task: Task) -> Environment:
        """A fresh environment for one episode of `task`."""

    def trajectory_reward(self, steps: Sequence[Step]) -> float:
        """The trajectory's reward from its steps: the sum of per-turn rewards."""
        return sum(step.reward for step in steps)

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        if self.max_turns < 1:
            raise WorkflowError(
                f"{type(self).__name__}.max_turns must be >= 1, got {self.max_turns}"
            )
        env = self.environment(task)
        transcript = Transcript()
        transcript.extend(self._opening(await env.reset(task)))
        steps: list[Step] = []
        for turn in range(self.max_turns):
            prompt = transcript.snapshot()
            output = await model.chat(list(prompt), **self.sampling(turn))
            transcript.append({"role": "assistant", "content": output.text})
            observation, reward, done = await env.step(output.text)
            truncated = not done and turn == self.max_turns - 1
            info = {"turn": turn, "done": done, "truncated": truncated, **self.step_info(env)}
            steps.append(Step(messages=prompt, output=output, reward=reward, info=info))
            if done:
                break
            self._observe(transcript, observation)
        return Trajectory(steps=steps, reward=self.trajectory_reward(steps))

    def sampling(self, turn: int) -> dict[str, Any]:
        """Sampling settings for turn `turn` (0-based) over the config's; none by default.

        E.g. a shorter `max_tokens` for the last turn, where only an answer fits the context.
        """
        return {}

    def step_info(self, env: Environment) -> dict[str, Any]:
        """Extra `Step.info` entries after a turn (e.g. `correct`); none by default."""
        return {}

    def _opening(self, observation: Observation) -> list[dict[str, Any]]:
        """The first observation as messages, `system_prompt` in front: merged into the
        environment's own system message if it opens with one (one system message, which some
        chat templates require)."""
        messages = [dict(m) for m in self._messages(observation)]
        if not self.system_prompt:
            return messages
        if messages and messages[0].get("role") == "system":
            merged = f"{self.system_prompt}\n\n{messages[0]['content']}"
            return [{**messages[0], "content": merged}, *messages[1:]]
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def _observe(self, transcript: Transcript, observation: Observation) -> None:
        transcript.extend(self._messages(observation))

    def _messages(self, observation: Observation) -> Sequence[dict[str, Any]]:
        if isinstance(observation, str):
            return [{"role": self.observation_role, "content": observation}]
        return observation

"""`CountdownWorkflow`: one prompt (`"3 7 12 -> 33"`), one expression back, scored exactly.

Config: `workflow: examples.countdown.workflow:CountdownWorkflow`. Sampling settings (keep
`max_tokens` small; answers are under 20 characters) come from the config's `sampling` section.
"""

from __future__ import annotations

from typing import Any

from examples.countdown.reward import countdown_reward
from examples.countdown.tasks import prompt
from unified.types import Task
from workflows.single_turn import SingleTurnWorkflow

__all__ = ["CountdownShapedWorkflow", "CountdownSparseWorkflow", "CountdownWorkflow"]


class CountdownWorkflow(SingleTurnWorkflow):
    """Ask for an expression reaching the target; reward 1.0 on a hit, `format_reward` on a miss."""

    format_reward: float = 0.1
    """Reward for a valid expression over the numbers that misses the target."""
    closeness_reward: float = 0.0
    """Extra reward, up to this much, for a miss whose value is near the target."""

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": prompt(task.data)}]

    def reward(self, task: Task, reply: str) -> tuple[float, bool]:
        return countdown_reward(
            reply,
            task.data,
            format_reward=self.format_reward,
            closeness_reward=self.closeness_reward,
        )


class CountdownSparseWorkflow(CountdownWorkflow):
    """Reward only exact hits: no credit for a well-formed miss."""

    format_reward = 0.0


class CountdownShapedWorkflow(CountdownWorkflow):
    """Also reward near misses, by how close their value is to the target."""

    closeness_reward = 0.3

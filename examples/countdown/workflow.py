"""`CountdownWorkflow`: one prompt (`"3 7 12 -> 33"`), one expression back, scored exactly.

Config: `workflow: examples.countdown.workflow:CountdownWorkflow`. Sampling settings (keep
`max_tokens` small; answers are under 20 characters) come from the config's `sampling` section;
`workflow_args: {closeness_reward: 0.3}` changes a credit for one run.
"""

from __future__ import annotations

from typing import Any

from examples.countdown.reward import countdown_reward
from examples.countdown.tasks import prompt
from unified.errors import UsageError
from unified.types import Task
from workflows.single_turn import SingleTurnWorkflow

__all__ = ["CountdownFormatWorkflow", "CountdownSparseWorkflow", "CountdownWorkflow"]


class CountdownWorkflow(SingleTurnWorkflow):
    """Ask for an expression reaching the target; 1.0 on a hit, partial credit for a near miss.

    The closeness credit is what makes the policy look at the target: with hits alone, a tiny
    model settles on the pattern that is right most often (`a+b+c`) whatever the target is
    (docs/benchmarks.md).
    """

    required_fields = ("numbers", "target")
    format_reward: float = 0.1
    """Reward for a valid expression over the numbers that misses the target."""
    closeness_reward: float = 0.45
    """Extra reward, up to this much, for an integer miss near the target (`countdown_reward`)."""

    def __init__(
        self, *, format_reward: float | None = None, closeness_reward: float | None = None
    ) -> None:
        """Override the class's credits per run: `workflow_args: {closeness_reward: 0.3}`."""
        for name, value in (
            ("format_reward", format_reward),
            ("closeness_reward", closeness_reward),
        ):
            if value is None:
                continue
            if not 0.0 <= value < 1.0:
                raise UsageError(f"{name} must be in [0, 1) (a hit earns 1.0), got {value}")
            setattr(self, name, float(value))

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": prompt(task.data)}]

    def reward(self, task: Task, reply: str) -> tuple[float, bool]:
        return countdown_reward(
            reply,
            task.data,
            format_reward=self.format_reward,
            closeness_reward=self.closeness_reward,
        )


class CountdownFormatWorkflow(CountdownWorkflow):
    """Credit a well-formed miss, however far from the target: no closeness credit."""

    closeness_reward = 0.0


class CountdownSparseWorkflow(CountdownWorkflow):
    """Reward only exact hits: no credit for a well-formed miss."""

    format_reward = 0.0
    closeness_reward = 0.0

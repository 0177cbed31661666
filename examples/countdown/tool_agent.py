"""`CountdownToolAgent`: countdown with a calculator the policy uses to check its candidates.

Each turn the policy either answers (`3 7 12 -> 33` -> `3*7+12`) or checks a candidate with
`calc` (`<tool_call>{"name": "calc", "arguments": {"expr": "3*7+12"}}</tool_call>`, written by
`tool_call`) and reads its exact value in a tool message. A check that hits the target solves the
episode at once; a miss leaves the policy another turn to try again, with the value it read.
Every attempt, checked or answered, is scored like the single-turn `CountdownWorkflow`'s answer
(integer closeness credit, format credit) and the episode scores its best attempt: a check is a
free attempt that shows its value, so checking pays, and RL learns which candidates to check and
what to try after a miss. A garbled call ends the episode with 0. The warm start checks half
the problems.

Config: `workflow: examples.countdown.tool_agent:CountdownToolAgent`. The tools are not declared
in a system message: the warm start teaches the one tool, and the built-in model has 256
positions, which hold two checks and an answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from examples.countdown.reward import countdown_reward, expression_value
from examples.countdown.tasks import prompt
from examples.countdown.workflow import CountdownWorkflow
from unified.types import Step, Task
from workflows.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from workflows.tools import ToolResult, ToolWorkflow

__all__ = ["ANSWER_TOKENS", "CountdownToolAgent", "calc", "calc_result", "tool_call"]

ANSWER_TOKENS = 24
"""`max_tokens` of the last turn: an answer over three numbers is at most 12 characters."""


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expr: Non-negative integers, + - * / and parentheses, e.g. 3*7+12.
    """
    return calc_result(expr)


def calc_result(expr: str) -> str:
    """What `calc` shows the model: `33`, `-5`, `7/3`, or `undefined` for a division by zero.

    Anything but arithmetic raises ValueError, which the workflow shows the model as an error
    (a malformed call). The numbers are not checked against the task: it is a calculator.
    """
    try:
        value, _ = expression_value(expr)
    except ZeroDivisionError:
        return "undefined"
    return str(value)


def tool_call(expr: str) -> str:
    """The reply that calls `calc` on `expr`, in the tool-call format (Qwen's JSON spacing, whose
    fixed pieces the built-in tokenizer spells as one token each)."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}})
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"


class CountdownToolAgent(ToolWorkflow):
    """Solve a countdown prompt in up to three attempts, each a `calc` check or the answer.

    An answer ends the episode; so does a check that hits the target, and a call that fails
    (the episode then scores 0). The last turn has room for an answer only (`ANSWER_TOKENS`): a
    call there is cut off, which fails it.
    """

    tools = (calc,)
    declare_tools = False
    max_turns = 3
    max_calls_per_turn = 1
    end_on_tool_error = True  # a garbled call's text and error would crowd out the next turns
    tool_timeout_s = 5.0

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": prompt(task.data)}]

    def reward(self, task: Task, answer: str) -> tuple[float, bool]:
        return countdown_reward(
            answer,
            task.data,
            format_reward=CountdownWorkflow.format_reward,
            closeness_reward=CountdownWorkflow.closeness_reward,
        )

    def tool_reward(self, task: Task, results: Sequence[ToolResult]) -> tuple[float, bool]:
        """A check scores its expression as an answer; one that hits the target solves the task.
        A turn with a failed call scores 0, unsolved: the episode ends there with 0."""
        if not all(r.ok for r in results):
            return 0.0, False
        scores = [self.reward(task, r.call.arguments["expr"]) for r in results]
        return max(scores, default=(0.0, False))

    def trajectory_reward(self, steps: Sequence[Step]) -> float:
        """The best attempt's score (a miss checked on the way costs nothing), or 0 after a
        garbled call: otherwise a good first attempt would shield the calls after it."""
        if any(step.info.get("tool_errors") for step in steps):
            return 0.0
        return max(step.reward for step in steps)

    def sampling(self, turn: int) -> dict[str, Any]:
        return {"max_tokens": ANSWER_TOKENS} if turn == self.max_turns - 1 else {}

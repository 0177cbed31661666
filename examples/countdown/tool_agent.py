"""`CountdownToolAgent`: countdown with a calculator the policy may call once before it answers.

An episode is one of two shapes. Answer directly: `3 7 12 -> 33` -> `3*7+12`. Or check first:
the policy calls `calc` on a candidate (`<tool_call>{"name":"calc","arguments":{"expr":"3*7+12"}}
</tool_call>`, written by `tool_call`), reads its exact value (`33`) in a tool message, and then
answers. The final answer is scored like the single-turn `CountdownWorkflow`'s; a call costs
nothing but tokens. What RL has to learn: when to check (the warm start checks half the time),
which candidate to check, and what to answer after reading the value (the checked candidate when
it hits the target, another expression when it misses).

Config: `workflow: examples.countdown.tool_agent:CountdownToolAgent`. The tools are not declared
in a system message: the warm start teaches the one tool, and the built-in model has 256
positions.
"""

from __future__ import annotations

import json
from typing import Any

from examples.countdown.reward import countdown_reward, expression_value
from examples.countdown.tasks import prompt
from examples.countdown.workflow import CountdownWorkflow
from unified.types import Task
from workflows.tool_calls import TOOL_CALL_END, TOOL_CALL_START
from workflows.tools import ToolWorkflow

__all__ = ["CountdownToolAgent", "calc", "calc_result", "tool_call"]


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
    """The reply that calls `calc` on `expr`, in the tool-call format (compact JSON)."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}}, separators=(",", ":"))
    return f"{TOOL_CALL_START}{body}{TOOL_CALL_END}"


class CountdownToolAgent(ToolWorkflow):
    """Answer a countdown prompt, optionally after one `calc` call on a candidate expression.

    A second call instead of an answer ends the episode at `max_turns` with reward 0.
    """

    tools = (calc,)
    declare_tools = False
    max_turns = 2
    max_calls_per_turn = 1
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

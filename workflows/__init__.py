"""Workflows: the async programs that turn a task into a trajectory by calling the policy."""

from workflows.base import Workflow
from workflows.multi_turn import Environment, MultiTurnWorkflow, Observation
from workflows.single_turn import SingleTurnWorkflow
from workflows.tool_calls import ToolCall, parse_tool_calls, tools_prompt
from workflows.tools import Tool, ToolResult, ToolWorkflow, run_tool_calls

__all__ = [
    "Environment",
    "MultiTurnWorkflow",
    "Observation",
    "SingleTurnWorkflow",
    "Tool",
    "ToolCall",
    "ToolResult",
    "ToolWorkflow",
    "Workflow",
    "parse_tool_calls",
    "run_tool_calls",
    "tools_prompt",
]

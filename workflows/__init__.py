"""Workflows: the async programs that turn a task into a trajectory by calling the policy."""

from workflows.base import Workflow
from workflows.single_turn import SingleTurnWorkflow

__all__ = ["SingleTurnWorkflow", "Workflow"]

"""`AgentWorkflow`: train an agent that speaks OpenAI's API, unchanged.

The agent is a user function `async def agent(task, base_url, api_key) -> reward`, written
against any OpenAI-compatible client (`openai.AsyncOpenAI(base_url=..., api_key=...)`, an agent
framework's model settings). Each rollout gets its own endpoint on the trainer's gateway
(`gateway.server`); the calls the agent makes there are the rollout's steps, with the exact
tokens and logprobs the policy sampled (`gateway.session`). The reward is a number, or a dict
with `reward` and, optionally, `correct` (what evaluation counts as solved) and other metrics
(kept in the last step's `info["metrics"]`).

Config:

    workflow: workflows.agent:AgentWorkflow
    workflow_args: {agent: examples.countdown.openai_agent:solve, declare_tools: false}

The workflow rules hold as for any workflow: the run's deadline (`workflow_timeout_s`) cancels
an agent that never returns, and its session closes with it; an agent that raises is an error
episode; the tokens count once, through the rollout's engine.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.server import Gateway, shared_gateway
from unified.errors import UsageError, WorkflowError
from unified.imports import import_object
from unified.protocol import RolloutEngine
from unified.types import Task, Trajectory

__all__ = ["AgentFn", "AgentWorkflow"]

AgentFn = Callable[[Task, str, str], Awaitable[Any]]
"""`async def agent(task, base_url, api_key) -> float | {"reward": float, ...}`."""


class AgentWorkflow:
    """One rollout of an OpenAI-client agent: a gateway session, the agent's run, its steps."""

    serving = staticmethod(shared_gateway)
    """The trainer keeps one gateway running around its rollouts (`workflow_serving`)."""

    def __init__(self, agent: str | AgentFn, *, declare_tools: bool = True) -> None:
        fn = import_object(agent, what="agent") if isinstance(agent, str) else agent
        if not inspect.iscoroutinefunction(fn):
            raise UsageError(
                f"agent {agent!r} is not an async function `async def agent(task, base_url, "
                "api_key)`"
            )
        self.agent: AgentFn = fn
        self.declare_tools = declare_tools
        """Render a request's `tools` into the prompt (the chat template's declaration); off
        for a model that learnt its tools without one (a short context). Calls parse either way."""

    async def run(self, task: Task, model: RolloutEngine) -> Trajectory:
        async with (
            Gateway.serving() as gateway,
            gateway.session(model, declare_tools=self.declare_tools) as session,
        ):
            result = await self.agent(task, gateway.base_url(session), session.api_key)
            steps = list(session.steps)
        if not steps:
            raise WorkflowError(
                "the agent made no model call through its base_url: nothing to train on; point "
                "its OpenAI client at the base_url and api_key it is given"
            )
        reward, info = _outcome(result)
        last = steps[-1]
        steps[-1] = last.model_copy(update={"info": {**last.info, **info}})
        return Trajectory(steps=steps, reward=reward)


def _outcome(result: Any) -> tuple[float, dict[str, Any]]:
    """The reward an agent returned, and what goes into its last step's info."""
    if isinstance(result, Mapping):
        if "reward" not in result:
            keys = ", ".join(map(str, result)) or "none"
            raise WorkflowError(f"the agent returned a dict without 'reward' (keys: {keys})")
        rest = {k: v for k, v in result.items() if k not in ("reward", "correct")}
        info: dict[str, Any] = {"metrics": rest} if rest else {}
        if "correct" in result:
            info["correct"] = bool(result["correct"])
        return _number(result["reward"]), info
    return _number(result), {}


def _number(reward: Any) -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise WorkflowError(
            f"the agent returned {type(reward).__name__}; return a number or a dict with 'reward'"
        )
    if not math.isfinite(reward):
        raise WorkflowError(f"the agent returned a reward of {reward}; it must be finite")
    return float(reward)

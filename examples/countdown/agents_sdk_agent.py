"""The countdown tool agent written with the OpenAI Agents SDK (`openai-agents`): no `unified`.

The agent of `openai_agent.py` as an Agents SDK user writes it: an `Agent` with a `calc`
function tool on an `OpenAIChatCompletionsModel` whose client points at the rollout's
`base_url`, run by `Runner.run` for at most three model calls. Every attempt, a checked
candidate or the answer, is scored like the single-turn answer and the episode scores its best;
a check that hits the target ends the run (`tool_use_behavior`). Differences from
`openai_agent.py`, which the SDK decides: the last call has no shorter `max_tokens`, and a call
the SDK cannot run (bad arguments) goes back to the model as an error message instead of ending
the episode. Tracing is off: it would send traces to OpenAI's servers.

    workflow: workflows.agent:AgentWorkflow
    workflow_args: {agent: examples.countdown.agents_sdk_agent:solve, declare_tools: false}
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    FunctionToolResult,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
)

from examples.countdown.openai_agent import MAX_TURNS, calc, client_for, score
from examples.countdown.tasks import prompt

__all__ = ["solve"]


async def solve(task: Any, base_url: str, api_key: str) -> dict[str, Any]:
    """One countdown episode run by the Agents SDK; the best attempt's reward."""
    data = task.data
    attempts: list[tuple[float, bool]] = []

    @function_tool
    def calc_tool(expr: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expr: Non-negative integers, + - * / and parentheses, e.g. 3*7+12.
        """
        attempts.append(score(expr, data))
        return calc(expr)

    calc_tool.name = "calc"

    def stop_when_solved(
        context: RunContextWrapper[Any], results: list[FunctionToolResult]
    ) -> ToolsToFinalOutputResult:
        solved = any(correct for _, correct in attempts)
        return ToolsToFinalOutputResult(is_final_output=solved, final_output="solved")

    client = client_for(base_url, api_key)  # one connection pool per event loop
    agent = Agent(
        name="countdown",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(),
        tools=[calc_tool],
        tool_use_behavior=stop_when_solved,
    )
    try:
        result = await Runner.run(
            agent, prompt(data), max_turns=MAX_TURNS, run_config=RunConfig(tracing_disabled=True)
        )
        answer = str(result.final_output)
        if answer != "solved":
            attempts.append(score(answer, data))
    except MaxTurnsExceeded:
        pass  # three calls, no answer: the checks made so far count
    best = max(attempts, default=(0.0, False))
    return {
        "reward": best[0],
        "correct": any(c for _, c in attempts),
        "checks": len(attempts),
    }


solve.max_turns = MAX_TURNS  # type: ignore[attr-defined]  # tries per task, for reports

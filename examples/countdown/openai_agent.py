"""The countdown tool agent written with the plain `openai` client: no `unified` in its code.

The same agent as `tool_agent.CountdownToolAgent`, as someone would write it for any
OpenAI-compatible endpoint: up to three chat calls; each reply either calls the `calc` tool,
whose result goes back as a `tool` message, or answers. Every attempt (a checked candidate or
the answer) is scored like the single-turn answer and the episode scores its best; a check that
hits the target solves it at once; a garbled call or a calc that fails ends it with 0. The last
call leaves room for an answer only (`ANSWER_TOKENS`).

Train it with `workflows.agent:AgentWorkflow` (`local_openai_agent_sync.yaml`): the trainer gives
each rollout its own `base_url` and `api_key`, and trains on the exact tokens of these calls.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

import openai

from examples.countdown.reward import countdown_reward, expression_value
from examples.countdown.tasks import prompt

__all__ = ["CALC", "client_for", "solve"]

ANSWER_TOKENS = 24
MAX_TURNS = 3
FORMAT_REWARD = 0.1  # CountdownWorkflow's credits, so the two agents learn from one signal
CLOSENESS_REWARD = 0.45

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "e.g. 3*7+12"}},
            "required": ["expr"],
        },
    },
}


_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.AsyncOpenAI] = (
    weakref.WeakKeyDictionary()
)


def client_for(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """A client for this rollout's endpoint, sharing one connection pool per event loop.

    A new `AsyncOpenAI` builds an httpx client, which loads the CA bundle into an SSL context:
    ~80 ms of CPU, on the event loop the trainer shares (64 rollouts a step: seconds).
    `with_options` re-points a client already made in 0.07 ms.
    """
    loop = asyncio.get_running_loop()
    shared = _CLIENTS.get(loop)
    if shared is None:
        shared = _CLIENTS[loop] = openai.AsyncOpenAI(api_key="per-rollout", max_retries=0)
    return shared.with_options(base_url=base_url, api_key=api_key)


def calc(expr: str) -> str:
    """`33`, `-5`, `7/3`, or `undefined`; ValueError for anything but arithmetic."""
    try:
        value, _ = expression_value(expr)
    except ZeroDivisionError:
        return "undefined"
    return str(value)


async def solve(task: Any, base_url: str, api_key: str) -> dict[str, Any]:
    """One countdown episode through an OpenAI-compatible endpoint; the reward and whether it
    was solved."""
    client = client_for(base_url, api_key)
    data = task.data
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt(data)}]
    best, solved, checks = 0.0, False, 0
    for turn in range(MAX_TURNS):
        limit = {"max_tokens": ANSWER_TOKENS} if turn == MAX_TURNS - 1 else {}
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC], **limit
        )  # type: ignore[call-overload]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            text = message.content or ""
            if "<tool_call>" in text:  # a call the endpoint could not parse
                return {"reward": 0.0, "correct": False, "checks": checks}
            reward, correct = score(text, data)
            return {"reward": max(best, reward), "correct": solved or correct, "checks": checks}
        if len(message.tool_calls) > 1:  # one check per turn, as CountdownToolAgent allows
            return {"reward": 0.0, "correct": False, "checks": checks}
        for call in message.tool_calls:
            checks += 1
            try:
                expr = json.loads(call.function.arguments)["expr"]
                result = calc(expr)
            except (ValueError, KeyError, TypeError):
                return {"reward": 0.0, "correct": False, "checks": checks}
            reward, correct = score(expr, data)
            best, solved = max(best, reward), solved or correct
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if solved:
            break
    return {"reward": best, "correct": solved, "checks": checks}


solve.max_turns = MAX_TURNS  # type: ignore[attr-defined]  # tries per task, for reports


def score(answer: str, data: Any) -> tuple[float, bool]:
    """An attempt's `(reward, correct)`, as the single-turn countdown workflow scores it."""
    return countdown_reward(
        answer, data, format_reward=FORMAT_REWARD, closeness_reward=CLOSENESS_REWARD
    )

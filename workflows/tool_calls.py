"""The tool-call text format: how a model calls a tool, and how tools are described to it.

One format, Hermes/Qwen style: a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
anywhere in the model's reply (several calls per reply are allowed); a reply with none is a final
answer. Parsing never raises: a call that is not valid JSON, names no tool, or is never closed
comes back as a `ToolCall` with `error` set, which the workflow shows the model as a tool result.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "ToolCall", "parse_tool_calls", "tools_prompt"]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from a reply: the tool's name and arguments, or why it is malformed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model reply, in order; empty when the reply is a final answer.

    One pass over the text (a reply that repeats the opening marker thousands of times must not
    cost quadratic time on the event loop).
    """
    calls: list[ToolCall] = []
    position = 0
    while (start := text.find(TOOL_CALL_START, position)) >= 0:
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        if end < 0:  # the model ran out or forgot to close: one error for the rest of the reply
            calls.append(ToolCall(name="", error=f"tool call not closed with {TOOL_CALL_END}"))
            break
        calls.append(_parse_one(text[body_start:end]))
        position = end + len(TOOL_CALL_END)
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", error=f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    except ValueError as e:  # e.g. an integer past Python's 4300-digit conversion limit
        return ToolCall(name="", error=f"tool call is not valid JSON ({e})")
    except RecursionError:  # a policy repeating "[" nests past the parser's depth
        return ToolCall(name="", error="tool call is nested too deeply")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(name="", error='tool call needs {"name": str, "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        with contextlib.suppress(ValueError, RecursionError):  # JSONDecodeError is one
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        got = type(arguments).__name__
        return ToolCall(name=call["name"], error=f"tool arguments must be an object, got {got}")
    return ToolCall(name=call["name"], arguments=arguments)


def tools_prompt(schemas: Sequence[dict[str, Any]]) -> str:
    """The system-prompt text that declares `schemas` (OpenAI function tools) and the format."""
    lines = [
        "You may call these tools. To call one, reply with "
        f'{TOOL_CALL_START}{{"name": <tool name>, "arguments": {{...}}}}{TOOL_CALL_END}; '
        "each result comes back in a tool message. Reply without a tool call to answer.",
        *(json.dumps(schema, separators=(",", ":")) for schema in schemas),
    ]
    return "\n".join(lines)

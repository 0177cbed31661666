"""`ToolWorkflow`: the policy answers a task, calling typed Python functions as tools on the way.

Tools are plain functions (sync or async) with type hints; the OpenAI function schema comes from
the signature (pydantic) and the docstring (first paragraph: the description; an `Args:` section:
the parameters'). Every call the model writes (format: `workflows.tool_calls`) is validated
against that schema and run under `tool_timeout_s`; sync tools run in a daemon thread of their
own, so a tool that never returns holds neither the sampler nor the interpreter's exit. The rule
this module keeps: a tool that raises, times out, or is called wrongly becomes an error message
the model reads in its next turn, never a crashed episode. Tool results are `role: tool`
messages, prompt tokens of the next turn: they never carry loss.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import threading
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from unified.threads import in_daemon_thread
from unified.types import Task
from workflows.multi_turn import Environment, MultiTurnWorkflow, Observation
from workflows.tool_calls import ToolCall, parse_tool_calls, tools_prompt

__all__ = ["MAX_STUCK_CALLS", "Tool", "ToolResult", "ToolWorkflow", "run_tool_calls"]

_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with its OpenAI schema and an argument validator."""

    name: str
    description: str
    fn: Callable[..., Any]
    arguments: type[BaseModel]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """Declare `fn` as a tool: every parameter needs a type hint; docstring describes it."""
        signature = inspect.signature(fn)
        hints = inspect.get_annotations(fn, eval_str=True)
        description, parameter_docs = _parse_docstring(inspect.getdoc(fn) or "")
        fields: dict[str, Any] = {}
        for name, parameter in signature.parameters.items():
            if name not in hints:
                raise TypeError(f"tool {fn.__name__}: parameter {name!r} needs a type hint")
            default = ... if parameter.default is inspect.Parameter.empty else parameter.default
            fields[name] = (hints[name], Field(default, description=parameter_docs.get(name)))
        model = create_model(
            f"{fn.__name__}_arguments",
            __config__=ConfigDict(extra="forbid"),  # a misspelt argument is an error, not a default
            **fields,
        )
        return cls(name=fn.__name__, description=description, fn=fn, arguments=model)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool declaration of this tool."""
        parameters = self.arguments.model_json_schema()
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }

    async def call(self, arguments: dict[str, Any]) -> str:
        """Validate `arguments`, run the tool (sync ones in a thread), return its result as text."""
        validated = self.arguments.model_validate(arguments)
        # Attributes, not `model_dump()`: a parameter typed as a model stays that model.
        values = {name: getattr(validated, name) for name in type(validated).model_fields}
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**values)
        else:
            result = await _in_thread(self, functools.partial(self.fn, **values))
        if inspect.isawaitable(result):  # an async tool behind a sync decorator
            result = await result
        return result if isinstance(result, str) else json.dumps(result, default=str)


# A sync tool's call past its timeout keeps its thread until the function returns (threads cannot
# be stopped). Past this many such threads of one tool, its further calls fail at once: a tool
# stuck for good would otherwise take one more thread per call for the rest of the run.
MAX_STUCK_CALLS = 32

_stuck: Counter[Callable[..., Any]] = Counter()  # per tool function: abandoned calls still running
_stuck_lock = threading.Lock()


class _ToolStuck(RuntimeError):
    """Too many of a tool's earlier calls are still running past their timeout."""


async def _in_thread(tool: Tool, call: Callable[[], Any]) -> Any:
    """Run a sync tool's call in a daemon thread; a call its caller gave up on (a timeout) counts
    as stuck until it returns."""
    with _stuck_lock:
        stuck = _stuck[tool.fn]
    if stuck >= MAX_STUCK_CALLS:
        raise _ToolStuck(
            f"{stuck} earlier calls of {tool.name!r} are still running past their timeout; "
            "not starting another"
        )
    finished = abandoned = False

    def run() -> Any:
        nonlocal finished
        try:
            return call()
        finally:
            with _stuck_lock:
                finished = True
                if abandoned:
                    _stuck[tool.fn] -= 1

    try:
        return await in_daemon_thread(run)
    except BaseException:
        with _stuck_lock:
            if not finished:
                abandoned = True
                _stuck[tool.fn] += 1
        raise


@functools.lru_cache(maxsize=1024)
def _declared(fn: Callable[..., Any]) -> Tool:
    # Building the argument model costs about a millisecond: once per function, not per episode.
    return Tool.from_function(fn)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    paragraphs = doc.split("\n\n")
    description = " ".join(paragraphs[0].split()) if doc else ""
    parameters: dict[str, str] = {}
    in_args = False
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and (match := _ARG_LINE.match(line)):
            parameters[match.group(1)] = match.group(2).strip()
        elif in_args and line.strip() and not line.startswith((" ", "\t")):
            in_args = False
    return description, parameters


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: the text the model reads, and whether the call failed."""

    call: ToolCall
    content: str
    ok: bool

    def message(self) -> dict[str, Any]:
        """The `role: tool` message that shows this result to the model.

        Text a tokenizer cannot encode (a lone surrogate the model wrote as a JSON escape, echoed
        back by the tool) is replaced, so the next turn's prompt always encodes.
        """
        content = self.content.encode("utf-8", "replace").decode("utf-8")
        return {"role": "tool", "name": self.call.name, "content": content}


async def run_tool_calls(
    calls: Sequence[ToolCall], tools: dict[str, Tool], timeout_s: float
) -> list[ToolResult]:
    """Run `calls` concurrently, each under `timeout_s`; failures come back as error text."""
    async with asyncio.TaskGroup() as group:
        running = [group.create_task(_run_one(call, tools, timeout_s)) for call in calls]
    return [task.result() for task in running]


async def _run_one(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    def failed(reason: str) -> ToolResult:
        return ToolResult(call, f"error: {reason}", ok=False)

    if call.error is not None:
        return failed(call.error)
    tool = tools.get(call.name)
    if tool is None:
        return failed(f"unknown tool {call.name!r}; available: {', '.join(sorted(tools))}")
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            return ToolResult(call, await tool.call(call.arguments), ok=True)
    except TimeoutError as e:
        if not deadline.expired():  # the tool's own timeout (a socket's, say), not ours
            return failed(f"TimeoutError: {e}")
        # A sync tool's thread cannot be stopped; it finishes in the background, unread.
        return failed(f"tool {call.name!r} timed out after {timeout_s:g} s")
    except _ToolStuck as e:
        return failed(str(e))
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}" for err in e.errors()
        )
        return failed(f"bad arguments for {call.name!r}: {problems}")
    except asyncio.CancelledError:
        if _being_cancelled():
            raise
        return failed(f"tool {call.name!r} raised CancelledError")
    except KeyboardInterrupt:
        raise
    # The tool's own failure is the model's observation, not a crash; that includes model-written
    # code calling exit() or raising BaseException itself. KeyboardInterrupt still ends the run.
    except BaseException as e:
        return failed(f"{type(e).__name__}: {e}")


def _being_cancelled() -> bool:
    """Whether this task was cancelled from outside (a CancelledError the tool raised is not)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class ToolWorkflow(MultiTurnWorkflow):
    """Subclass with `tools`, `messages(task)` and `reward(task, answer)`.

    Each turn the model may call tools (results come back as `role: tool` messages) or answer;
    the answer (a reply with no tool call) ends the episode and is scored by `reward`, which
    returns a float or `(reward, correct)`. A turn of calls is scored by `tool_reward` (0 unless
    overridden), which may also end the episode solved. An episode that reaches `max_turns`
    still calling tools gets only its turns' rewards. The tools are declared in a system message
    (`workflows.tool_calls`), so any chat template renders them.
    """

    tools: ClassVar[Sequence[Callable[..., Any]]] = ()
    declare_tools: bool = True
    """Declare the tools in a system message; off for a model that learnt them (a short context)."""
    tool_timeout_s: float = 10.0
    max_calls_per_turn: int = 4
    end_on_tool_error: bool = False
    """End the episode at a turn whose call failed (it scores `tool_reward`) instead of showing
    the error: for a model with a short context, where a garbled call leaves no room to recover."""
    observation_role = "tool"
    max_turns = 4

    @abstractmethod
    def messages(self, task: Task) -> list[dict[str, Any]]:
        """The opening conversation (the tools' system message is added in front)."""

    @abstractmethod
    def reward(self, task: Task, answer: str) -> float | tuple[float, bool]:
        """Score the final answer."""

    def tool_reward(self, task: Task, results: Sequence[ToolResult]) -> float | tuple[float, bool]:
        """The reward of a turn that called tools; `(reward, True)` ends the episode solved.

        0 by default. Override it when a tool can prove an answer (a test suite that passes, a
        calculator that shows the target): the episode then ends at that turn, marked correct.
        """
        return 0.0

    def tools_for(self, task: Task) -> Sequence[Callable[..., Any]]:
        """The tools of an episode of `task`: `tools` unless overridden."""
        return self.tools

    def environment(self, task: Task) -> Environment:
        return _ToolEnvironment(self, [_declared(fn) for fn in self.tools_for(task)])

    def step_info(self, env: Environment) -> dict[str, Any]:
        assert isinstance(env, _ToolEnvironment)
        return env.last_info


class _ToolEnvironment:
    """A tool-using episode as an environment: calls are run, an answer is scored."""

    def __init__(self, workflow: ToolWorkflow, tools: list[Tool]) -> None:
        self.workflow = workflow
        self.tools = {tool.name: tool for tool in tools}
        self.task: Task | None = None
        self.last_info: dict[str, Any] = {}

    async def reset(self, task: Task) -> Observation:
        self.task = task
        messages = [dict(m) for m in self.workflow.messages(task)]
        if not (self.tools and self.workflow.declare_tools):
            return messages
        declaration = tools_prompt([tool.schema() for tool in self.tools.values()])
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{declaration}"
            return messages
        return [{"role": "system", "content": declaration}, *messages]

    async def step(self, action: str) -> tuple[Observation, float, bool]:
        assert self.task is not None, "reset() comes first"
        calls = parse_tool_calls(action)
        if not calls:
            scored = self.workflow.reward(self.task, action)
            reward, correct = scored if isinstance(scored, tuple) else (scored, scored > 0)
            self.last_info = {"tool_calls": 0, "correct": correct}
            return [], reward, True
        limit = self.workflow.max_calls_per_turn
        written = len(calls)  # the calls past the limit are not run: each counts as failed
        if written > limit:
            calls = [*calls[:limit], ToolCall(name="", error=f"at most {limit} calls per turn")]
        results = await run_tool_calls(calls, self.tools, self.workflow.tool_timeout_s)
        errors = sum(not result.ok for result in results[:limit]) + max(0, written - limit)
        scored = self.workflow.tool_reward(self.task, results)
        reward, solved = scored if isinstance(scored, tuple) else (scored, False)
        self.last_info = {"tool_calls": written, "tool_errors": errors, "correct": solved}
        done = solved or (errors > 0 and self.workflow.end_on_tool_error)
        return [result.message() for result in results], reward, done

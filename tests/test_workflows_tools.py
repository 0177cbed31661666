"""Tool workflows: schemas from typed functions, the call format, and failures as observations."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from tests.agents import LOOKUP_CALL, LookupBanditWorkflow, ScriptedEngine, ToolBanditBackend
from tests.conftest import ConfigFactory
from unified import UnifiedTrainer
from unified.testing import bandit_tasks
from unified.types import Task
from workflows import tools as tools_module
from workflows.tool_calls import ToolCall, parse_tool_calls
from workflows.tools import Tool, ToolResult, ToolWorkflow, run_tool_calls

TASK = Task(id="t", data={"a": 2, "b": 3})


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


async def fail(reason: str) -> str:
    """Always raise."""
    raise ValueError(reason)


never = asyncio.Event()


async def hang(mode: Literal["slow", "stuck"]) -> str:
    """Never return."""
    await never.wait()
    return mode


TOOLS = {t.name: t for t in map(Tool.from_function, (add, fail, hang))}


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_tool_schema_comes_from_the_signature_and_docstring() -> None:
    schema = TOOLS["add"].schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert (function["name"], function["description"]) == ("add", "Add two integers.")
    assert function["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first addend."},
        "b": {"type": "integer", "description": "The second addend.", "default": 0},
    }
    assert function["parameters"]["required"] == ["a"]
    assert TOOLS["hang"].schema()["function"]["parameters"]["properties"]["mode"]["enum"] == [
        "slow",
        "stuck",
    ]


def test_a_parameter_without_a_type_hint_is_refused_by_name() -> None:
    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(TypeError, match="parameter 'x' needs a type hint"):
        Tool.from_function(untyped)


def test_calls_are_parsed_in_order_and_a_reply_without_one_is_an_answer() -> None:
    text = f"let me see {call('add', a=1, b=2)} and {call('fail', reason='x')}"
    assert parse_tool_calls(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("fail", {"reason": "x"}),
    ]
    assert parse_tool_calls("42") == []
    stringly = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(stringly) == [ToolCall("add", {"a": 1})], "JSON-string arguments"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs {"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "add", "arguments": {}}', "not closed"),
        ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "nested too deeply"),
        # Past Python's integer-conversion limit json raises a plain ValueError.
        ('<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>", "JSON"),
    ],
)
def test_a_malformed_call_is_parsed_into_an_error_not_raised(text: str, error: str) -> None:
    (parsed,) = parse_tool_calls(text)
    assert parsed.error is not None and error in parsed.error


def test_a_reply_repeating_the_opening_marker_parses_in_linear_time() -> None:
    """A policy stuck repeating `<tool_call>` (one token) must not stall the event loop."""
    small, large = "<tool_call>" * 2_000, "<tool_call>" * 32_000
    timings = []
    for text in (small, large):
        start = time.perf_counter()
        (parsed,) = parse_tool_calls(text)
        timings.append(time.perf_counter() - start)
        assert parsed.error is not None and "not closed" in parsed.error
    assert timings[1] < 0.5, f"{timings[1]:.2f} s for 32k markers"
    marker_inside = f"<tool_call>x{call('add', a=1)}"
    assert [c.error is not None for c in parse_tool_calls(marker_inside)] == [True]


async def test_tool_failures_become_error_results_the_model_reads() -> None:
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("fail", {"reason": "boom"}),
        ToolCall("add", {"a": "two"}),
        ToolCall("nope", {}),
        ToolCall("", error="tool call is not valid JSON"),
    ]
    results = await run_tool_calls(calls, TOOLS, timeout_s=5)
    assert [r.ok for r in results] == [True, False, False, False, False]
    assert results[0].message() == {"role": "tool", "name": "add", "content": "5"}
    assert results[1].content == "error: ValueError: boom"
    assert results[2].content.startswith("error: bad arguments for 'add': a:")
    assert "unknown tool 'nope'" in results[3].content
    assert results[4].content == "error: tool call is not valid JSON"


async def test_a_tool_past_its_timeout_becomes_an_error_result() -> None:
    (result,) = await run_tool_calls([ToolCall("hang", {"mode": "stuck"})], TOOLS, timeout_s=0.05)
    assert not result.ok and result.content == "error: tool 'hang' timed out after 0.05 s"


async def test_a_misspelt_argument_is_a_bad_call_not_a_default() -> None:
    (result,) = await run_tool_calls([ToolCall("add", {"a": 1, "bb": 2})], TOOLS, timeout_s=5)
    assert not result.ok and "bad arguments for 'add': bb:" in result.content


class Point(BaseModel):
    x: float
    y: float


async def test_a_parameter_typed_as_a_model_reaches_the_tool_as_that_model() -> None:
    def norm1(p: Point) -> float:
        """The L1 norm of a point."""
        return abs(p.x) + abs(p.y)

    tools = {"norm1": Tool.from_function(norm1)}
    (result,) = await run_tool_calls([ToolCall("norm1", {"p": {"x": 1, "y": -2}})], tools, 5)
    assert (result.ok, result.content) == (True, "3.0")


async def test_exit_and_a_cancelled_error_inside_a_tool_become_error_results() -> None:
    def quits(code: int) -> str:
        """Model-written code that calls exit()."""
        sys.exit(code)

    async def cancels() -> str:
        """Raise CancelledError without being cancelled."""
        raise asyncio.CancelledError

    tools = {t.name: t for t in map(Tool.from_function, (quits, cancels))}
    results = await run_tool_calls([ToolCall("quits", {"code": 3}), ToolCall("cancels")], tools, 5)
    assert [r.content for r in results] == [
        "error: SystemExit: 3",
        "error: tool 'cancels' raised CancelledError",
    ]


async def test_a_tools_own_timeout_and_a_bare_base_exception_become_error_results() -> None:
    async def fetch() -> str:
        """A client whose socket timed out, well inside the tool's deadline."""
        raise TimeoutError("read timed out")

    def judge() -> str:
        """Model-written code raising BaseException (or a test framework's failure)."""
        raise BaseException("assertion in model code")

    tools = {t.name: t for t in map(Tool.from_function, (fetch, judge))}
    results = await run_tool_calls([ToolCall("fetch"), ToolCall("judge")], tools, timeout_s=30)
    assert [r.content for r in results] == [
        "error: TimeoutError: read timed out",
        "error: BaseException: assertion in model code",
    ]


async def test_a_lone_surrogate_echoed_by_a_tool_still_encodes_in_the_next_prompt() -> None:
    def echo(text: str) -> str:
        """Return the text."""
        return text

    tools = {"echo": Tool.from_function(echo)}
    (parsed,) = parse_tool_calls(
        '<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>'
    )
    (result,) = await run_tool_calls([parsed], tools, timeout_s=5)
    content = result.message()["content"]
    assert result.ok and content == "a?b"
    content.encode("utf-8")  # what a tokenizer does first


async def test_an_async_tool_behind_a_sync_decorator_is_awaited() -> None:
    def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            return fn(**kwargs)

        return wrapper

    @logged
    async def double(n: int) -> int:
        """Twice n."""
        return 2 * n

    tools = {"double": Tool.from_function(double)}
    (result,) = await run_tool_calls([ToolCall("double", {"n": 4})], tools, 5)
    assert (result.ok, result.content) == (True, "8")


EPISODE: contextvars.ContextVar[str] = contextvars.ContextVar("episode", default="none")


async def test_a_sync_tool_sees_the_context_variables_of_its_episode() -> None:
    def which() -> str:
        """The episode this call belongs to."""
        return EPISODE.get()

    EPISODE.set("episode-7")
    (result,) = await run_tool_calls([ToolCall("which")], {"which": Tool.from_function(which)}, 5)
    assert result.content == "episode-7"


async def test_sync_tools_stuck_past_their_timeout_hold_no_shared_thread() -> None:
    release = threading.Event()

    def stuck() -> str:
        """Never return (until the test ends)."""
        release.wait(30)
        return "late"

    tools = {"stuck": Tool.from_function(stuck)}
    try:
        results = await run_tool_calls([ToolCall("stuck")] * 16, tools, timeout_s=0.05)
        assert all("timed out" in r.content for r in results)
        async with asyncio.timeout(5):  # the default executor (sampler, backend calls) is free
            assert await asyncio.gather(*[asyncio.to_thread(int, "1") for _ in range(16)])
    finally:
        release.set()


async def test_a_sync_tool_with_too_many_calls_stuck_fails_at_once_until_they_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tools_module, "MAX_STUCK_CALLS", 3)
    release = threading.Event()

    def held() -> str:
        """Return once the test lets it."""
        release.wait(30)
        return "done"

    tools = {"held": Tool.from_function(held)}
    threads = threading.active_count()
    try:
        timed_out = await run_tool_calls([ToolCall("held")] * 3, tools, timeout_s=0.05)
        assert all("timed out" in r.content for r in timed_out)
        (refused,) = await run_tool_calls([ToolCall("held")], tools, timeout_s=5)
        assert refused.content == (
            "error: 3 earlier calls of 'held' are still running past their timeout; "
            "not starting another"
        )
        assert threading.active_count() == threads + 3, "the refused call started no thread"
    finally:
        release.set()

    def returned() -> bool:
        deadline = time.monotonic() + 5
        while tools_module._stuck[held] and time.monotonic() < deadline:
            time.sleep(0.01)
        return tools_module._stuck[held] == 0

    assert await asyncio.to_thread(returned), "calls that returned count as stuck no more"
    (served,) = await run_tool_calls([ToolCall("held")], tools, timeout_s=5)
    assert served.ok and served.content == "done"


class Adder(ToolWorkflow):
    tools = (add, fail)
    max_turns = 3

    def messages(self, task: Task) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"{task.data['a']} + {task.data['b']}?"}]

    def reward(self, task: Task, answer: str) -> tuple[float, bool]:
        correct = answer.strip() == str(task.data["a"] + task.data["b"])
        return float(correct), correct


async def test_tool_results_come_back_as_tool_messages_and_the_answer_is_scored() -> None:
    engine = ScriptedEngine([call("fail", reason="flaky"), call("add", a=2, b=3), "5"])
    trajectory = await Adder().run(TASK, engine)
    assert len(trajectory.steps) == 3 and trajectory.reward == 1.0
    assert trajectory.steps[-1].info["correct"] is True
    assert trajectory.steps[0].info == {
        "turn": 0, "done": False, "truncated": False,
        "tool_calls": 1, "tool_errors": 1, "correct": False,
    }  # fmt: skip
    last_prompt = engine.prompts[-1]
    assert last_prompt[0]["role"] == "system" and '"name":"add"' in last_prompt[0]["content"]
    tool_messages = [m for m in last_prompt if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["error: ValueError: flaky", "5"]


async def test_an_episode_that_only_calls_tools_until_the_limit_scores_zero() -> None:
    engine = ScriptedEngine([call("add", a=1)] * 3)
    trajectory = await Adder().run(TASK, engine)
    assert len(trajectory.steps) == 3 and trajectory.reward == 0.0
    assert trajectory.steps[-1].info["truncated"]


async def test_a_turn_of_calls_is_scored_and_a_result_that_proves_the_answer_solves_it() -> None:
    class Checked(Adder):
        def tool_reward(self, task: Task, results: Sequence[ToolResult]) -> tuple[float, bool]:
            solved = any(r.content == str(task.data["a"] + task.data["b"]) for r in results)
            return (1.0 if solved else 0.25), solved

    engine = ScriptedEngine([call("add", a=1, b=1), call("add", a=2, b=3), "never asked"])
    trajectory = await Checked().run(TASK, engine)
    assert [s.reward for s in trajectory.steps] == [0.25, 1.0] and trajectory.reward == 1.25
    assert trajectory.steps[-1].info["correct"] and trajectory.steps[-1].info["done"]
    assert engine.replies == ["never asked"]


async def test_end_on_tool_error_ends_the_episode_at_a_failed_call() -> None:
    class Strict(Adder):
        end_on_tool_error = True

    engine = ScriptedEngine([call("add", a=1), call("fail", reason="flaky"), "5"])
    trajectory = await Strict().run(TASK, engine)
    assert len(trajectory.steps) == 2 and trajectory.reward == 0.0
    assert trajectory.steps[-1].info["done"] and trajectory.steps[-1].info["tool_errors"] == 1
    assert engine.replies == ["5"], "the error was not shown to the model"


async def test_calls_past_the_per_turn_limit_count_as_written_and_failed() -> None:
    class One(Adder):
        max_calls_per_turn = 1

    engine = ScriptedEngine([call("add", a=1) * 3, "5"])
    trajectory = await One().run(TASK, engine)
    info = trajectory.steps[0].info
    assert (info["tool_calls"], info["tool_errors"]) == (3, 2)
    tool_messages = [m["content"] for m in engine.prompts[-1] if m["role"] == "tool"]
    assert tool_messages == ["1", "error: at most 1 calls per turn"]


async def test_a_system_prompt_and_the_tools_declaration_share_one_system_message() -> None:
    class Prompted(Adder):
        system_prompt = "Be brief."

    engine = ScriptedEngine(["5"])
    await Prompted().run(TASK, engine)
    (system, user) = engine.prompts[0]
    assert system["role"] == "system" and user["role"] == "user"
    assert system["content"].startswith("Be brief.\n\n") and '"name":"add"' in system["content"]


async def test_without_declared_tools_no_system_message_is_added() -> None:
    class Quiet(Adder):
        declare_tools = False

    engine = ScriptedEngine(["5"])
    await Quiet().run(TASK, engine)
    assert [m["role"] for m in engine.prompts[0]] == ["user"]


def test_a_tool_workflow_trains_end_to_end_for_two_steps(make_config: ConfigFactory) -> None:
    backend = ToolBanditBackend()
    config = make_config(workflow="tests.agents:LookupBanditWorkflow", trainer={"total_steps": 2})
    result = UnifiedTrainer(
        config, backend=backend, train_tasks=bandit_tasks(8), workflow=LookupBanditWorkflow
    ).fit()
    assert result.steps == 2 and result.metrics["episodes/errors"] == 0
    calls = [s for s in backend.steps_seen if s.output.text == LOOKUP_CALL]
    answers = [s for s in backend.steps_seen if s.output.text.isdigit()]
    assert calls and len(calls) == len(answers), "every episode: one tool call, then an answer"
    assert all(s.messages[-1]["role"] == "tool" for s in answers), "answers saw the tool result"
    assert all(s.messages[-1]["content"] == "pick your target" for s in answers)
    rollout = {k: v for k, v in result.metrics.items() if k.startswith("rollout/tool")}
    assert rollout == {
        "rollout/tool_calls": 1.0,
        "rollout/tool_calls_well_formed": 1.0,
        "rollout/tool_use": 1.0,
        "rollout/tool_use_well_formed": 1.0,
    }, "the training episodes' calls are counted as eval's are"


def test_the_builtin_template_renders_the_tools_list_and_tool_messages() -> None:
    from torchkit.builtin import build_tokenizer

    tokenizer = build_tokenizer()
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": call("add", a=2, b=3)},
        {"role": "tool", "name": "add", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[TOOLS["add"].schema()], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith('<|system|>{"type": "function"'), "tools open the prompt"
    assert text.endswith("<|tool|>5<|im_end|><|assistant|>")
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False)
    assert plain == "<|user|>2+3?<|im_end|>", "no tools, no system message"

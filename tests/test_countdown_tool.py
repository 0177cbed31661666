"""The tool-using countdown agent: its calculator, its warm-start data, its masks, its runs."""

from __future__ import annotations

from typing import Any

import pytest

from backends.tinker.datums import group_sequences
from examples.countdown.reward import parse_expression
from examples.countdown.tool_agent import CountdownToolAgent, calc, tool_call
from examples.countdown.warmstart import tool_warmstart_examples, warmstart_examples
from tests.agents import ScriptedEngine, local_loss_samples
from tests.conftest import ConfigFactory
from unified.evaluation import tool_call_metrics
from unified.trainer import UnifiedTrainer
from unified.types import Episode, Task, Trajectory, TrajectoryGroup
from workflows.tool_calls import parse_tool_calls

TASK = Task(id="t", data={"numbers": [3, 7, 12], "target": 33})


async def episode(*replies: str) -> tuple[Trajectory, ScriptedEngine]:
    engine = ScriptedEngine(list(replies))
    return await CountdownToolAgent().run(TASK, engine), engine


def group_of(trajectory: Trajectory) -> TrajectoryGroup:
    ep = Episode(task_id="t", rollout_index=0, trajectories=[trajectory])
    return TrajectoryGroup(task_id="t", episodes=[ep], advantages=[1.0], policy_version=0)


@pytest.mark.parametrize(
    ("expr", "shown"),
    [("3*7+12", "33"), ("3-7", "-4"), ("7/3", "7/3"), ("(1+2)/0", "undefined"), (" 2*3 ", "6")],
)
def test_calc_shows_the_exact_value(expr: str, shown: str) -> None:
    assert calc(expr) == shown


@pytest.mark.parametrize("expr", ["3x", "__import__('os')", "2**8", "-3", "", "1" * 100])
def test_calc_refuses_anything_but_arithmetic(expr: str) -> None:
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calc(expr)


def test_tool_warmstart_calls_parse_and_show_the_calc_value() -> None:
    examples = [e["messages"] for e in tool_warmstart_examples(400, seed=1)]
    checked = [m for m in examples if len(m) == 4]
    calls = [m for m in examples if m[-1]["content"].startswith("<tool_call>")]
    assert 0.3 < len(checked) / len(examples) < 0.7, "about half the turns belong to checks"
    assert len(calls) >= len(checked) - 1, "every check is preceded by its call turn"
    for messages in checked:
        user, call, result, answer = messages
        (parsed,) = parse_tool_calls(call["content"])
        assert parsed.error is None and parsed.name == "calc", call["content"]
        assert call["content"] == tool_call(parsed.arguments["expr"]), "one compact format"
        assert result == {"role": "tool", "name": "calc", "content": calc(parsed.arguments["expr"])}
        numbers = [int(x) for x in user["content"].split(" -> ")[0].split()]
        assert parse_expression(answer["content"], numbers) is not None, answer
        if result["content"] == user["content"].split(" -> ")[1]:
            assert answer["content"] == parsed.arguments["expr"], "a hit is answered as checked"


def test_tool_warmstart_without_checks_is_the_single_turn_warmstart() -> None:
    assert tool_warmstart_examples(60, seed=4, tool_share=0.0) == warmstart_examples(60, seed=4)


async def test_the_agent_answers_after_reading_the_calc_value() -> None:
    trajectory, engine = await episode(tool_call("3*7+12"), "3*7+12")
    assert trajectory.reward == 1.0 and trajectory.steps[-1].info["correct"]
    assert engine.prompts[1][-1] == {"role": "tool", "name": "calc", "content": "33"}
    assert [m["role"] for m in engine.prompts[0]] == ["user"], "no tools system message"


async def test_a_second_call_instead_of_an_answer_scores_zero() -> None:
    trajectory, _ = await episode(tool_call("3+7"), tool_call("3*7+12"))
    assert trajectory.reward == 0.0 and trajectory.steps[-1].info["truncated"]


async def test_eval_metrics_count_calls_and_the_well_formed_share() -> None:
    runs = [
        await episode(tool_call("3*7+12"), "3*7+12"),
        await episode('<tool_call>{"name":"calc","arguments":{"expr":"3x"}}</tool_call>', "1"),
        await episode("<tool_call>{", "3+7+12"),
        await episode("3+7+12"),
    ]
    episodes = [Episode(task_id="t", rollout_index=0, trajectories=[t]) for t, _ in runs]
    metrics = tool_call_metrics(episodes)
    assert metrics == {"eval/tool_calls": 0.75, "eval/tool_calls_well_formed": pytest.approx(1 / 3)}


async def test_calc_tokens_never_train() -> None:
    trajectory, engine = await episode(tool_call("3*7+12"), "3*7+12")
    first, second = (step.output for step in trajectory.steps)
    (sequence,) = group_sequences([group_of(trajectory)])
    sampled = [t for t, s in zip(sequence.tokens, sequence.sampled, strict=True) if s]
    assert sampled == first.completion_ids + second.completion_ids, "tinker: model tokens only"
    samples, logp_T, _ = await local_loss_samples(group_of(trajectory))
    assert [s.completion for s in samples] == [first.completion_ids, second.completion_ids]
    assert logp_T.numel() == len(first.completion_ids) + len(second.completion_ids)
    tool_ids = engine.tokenizer.encode("<|im_start|>tool\n33<|im_end|>")
    observation = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids) :]
    assert observation[: len(tool_ids)] == tool_ids, "the tool result is prompt, not completion"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_tool_agent_trains_end_to_end(make_config: ConfigFactory, mode: str) -> None:
    tasks: dict[str, Any] = {"generator": "examples.countdown.tasks:make_tasks", "n": 16}
    config = make_config(
        mode=mode,
        backend="local",
        workflow="examples.countdown.tool_agent:CountdownToolAgent",
        model="builtin:tiny",
        data={"train": tasks, "eval": {**tasks, "n": 4, "split": "eval"}},
        trainer={
            "total_steps": 2,
            "batch_size": 2,
            "group_size": 2,
            "filter_groups": False,
            "eval_every": 2,
            "workflow_timeout": 120,  # two model calls each, on a loaded 2-core CI machine
        },
        sampling={"train": {"max_tokens": 16}, "eval": {"max_tokens": 16}},
    )
    result = UnifiedTrainer(config).fit()
    assert result.steps == 2 and result.metrics["episodes/errors"] == 0
    assert "eval/tool_calls" in result.metrics, "the tool agent's eval counts its calls"

"""The tool-using countdown agent: its calculator, its warm-start data, its masks, its runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from examples.countdown.reward import parse_expression
from examples.countdown.tool_agent import ANSWER_TOKENS, CountdownToolAgent, calc, tool_call
from examples.countdown.warmstart import tool_warmstart_examples, warmstart_examples
from tests.agents import ScriptedEngine, local_loss_rows
from tests.conftest import ConfigFactory
from unified.evaluation import tool_call_metrics
from unified.sequences import sequences_of
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


def test_tool_warmstart_checks_parse_show_the_calc_value_and_end_at_a_hit() -> None:
    examples = [e["messages"] for e in tool_warmstart_examples(600, seed=1, max_checks=2)]
    calls = [m for m in examples if m[-1]["content"].startswith("<tool_call>")]
    assert 0.4 < len(calls) / len(examples) < 0.9, "half the problems, up to three turns each"
    after_checks = [m for m in examples if len(m) > 2]
    assert any(len(m) == 6 for m in after_checks), "two misses, then an answer"
    for messages in after_checks:
        user, *turns, reply = messages
        target = user["content"].split(" -> ")[1]
        numbers = [int(x) for x in user["content"].split(" -> ")[0].split()]
        checked = []
        for call, result in zip(turns[::2], turns[1::2], strict=True):
            (parsed,) = parse_tool_calls(call["content"])
            assert parsed.error is None and parsed.name == "calc", call["content"]
            assert call["content"] == tool_call(parsed.arguments["expr"]), "one compact format"
            value = calc(parsed.arguments["expr"])
            assert result == {"role": "tool", "name": "calc", "content": value}
            assert value != target, "a hit ends the episode: nothing follows it"
            checked.append(parsed.arguments["expr"])
        assert len(checked) == len(set(checked)) <= 2, "distinct candidates, at most two checks"
        attempt = reply["content"]
        if attempt.startswith("<tool_call>"):
            (parsed,) = parse_tool_calls(attempt)
            attempt = parsed.arguments["expr"]
        assert parse_expression(attempt, numbers) is not None, attempt


def test_tool_warmstart_without_checks_is_the_single_turn_warmstart() -> None:
    assert tool_warmstart_examples(60, seed=4, tool_share=0.0) == warmstart_examples(60, seed=4)


async def test_a_check_that_hits_solves_the_episode_at_once() -> None:
    trajectory, engine = await episode(tool_call("3*7+12"), "never asked")
    assert len(trajectory.steps) == 1 and trajectory.steps[0].info["correct"]
    assert trajectory.reward == 1.0 and engine.replies == ["never asked"]
    assert [m["role"] for m in engine.prompts[0]] == ["user"], "no tools system message"


async def test_after_a_miss_the_agent_reads_the_value_and_tries_again() -> None:
    trajectory, engine = await episode(tool_call("3+7+12"), "3*7+12")
    assert engine.prompts[1][-1] == {"role": "tool", "name": "calc", "content": "22"}
    assert trajectory.reward == 1.0 and trajectory.steps[-1].info["correct"]


async def test_the_episode_scores_its_best_attempt_and_the_last_turn_fits_only_an_answer() -> None:
    trajectory, engine = await episode(tool_call("3+7+12"), tool_call("3*7-12"), "3+7x12")
    rewards = [step.reward for step in trajectory.steps]
    assert rewards[2] == 0.0 and 0.0 < rewards[1] < rewards[0] < 1.0, "22, then 9, miss 33"
    assert trajectory.reward == max(rewards) and not trajectory.steps[-1].info["correct"]
    assert engine.sampling == [{}, {}, {"max_tokens": ANSWER_TOKENS}]


async def test_a_garbled_call_ends_the_episode_and_forfeits_it() -> None:
    trajectory, engine = await episode(tool_call("3+7+12"), "<tool_call>{", "never asked")
    assert engine.replies == ["never asked"], "no third turn after a garbled call"
    assert trajectory.steps[0].reward > 0.0 and trajectory.steps[1].reward == 0.0
    assert trajectory.reward == 0.0, "a good first attempt does not shield a garbled call"
    last = trajectory.steps[-1].info
    assert last["tool_errors"] == 1 and last["done"]


async def test_eval_metrics_count_calls_episodes_that_call_and_well_formed_ones() -> None:
    runs = [
        await episode(tool_call("3*7+12")),
        await episode('<tool_call>{"name":"calc","arguments":{"expr":"3x"}}</tool_call>', "1"),
        await episode(tool_call("3+7+12"), "<tool_call>{"),
        await episode("3+7+12"),
    ]
    episodes = [Episode(task_id="t", rollout_index=0, trajectories=[t]) for t, _ in runs]
    assert tool_call_metrics(episodes) == {
        "eval/tool_calls": 1.0,
        "eval/tool_calls_well_formed": pytest.approx(2 / 4),
        "eval/tool_use": 0.75,
        "eval/tool_use_well_formed": 0.25,
    }


async def test_calc_tokens_never_train() -> None:
    trajectory, engine = await episode(tool_call("3+7+12"), "3*7+12")
    first, second = (step.output for step in trajectory.steps)
    (sequence,) = sequences_of([group_of(trajectory)], loss="ppo")
    sampled = [t for t, s in zip(sequence.tokens, sequence.mask, strict=True) if s]
    assert sampled == first.completion_ids + second.completion_ids, "tinker: model tokens only"
    (row,), logp_T, _ = await local_loss_rows(group_of(trajectory))
    row_sampled = [t for t, s in zip(row.tokens, row.mask, strict=True) if s]
    assert row_sampled == first.completion_ids + second.completion_ids
    assert row.tokens == second.prompt_ids + second.completion_ids, "both turns, one forward pass"
    assert logp_T.numel() == len(first.completion_ids) + len(second.completion_ids)
    tool_ids = engine.tokenizer.encode("<|tool|>22<|im_end|>")
    observation = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids) :]
    assert observation[: len(tool_ids)] == tool_ids, "the tool result is prompt, not completion"


def test_two_checks_and_an_answer_fit_the_builtin_context() -> None:
    engine = ScriptedEngine([])
    longest = tool_call("(20-19)/(18)")  # longer than any three-number expression
    messages = [{"role": "user", "content": "20 19 18 -> 100"}]
    for _ in range(2):
        messages += [
            {"role": "assistant", "content": longest},
            {"role": "tool", "name": "calc", "content": "-6840/361"},
        ]
    assert len(engine.encode_chat(messages)) + ANSWER_TOKENS <= 256


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
            "workflow_timeout_s": 120,  # up to three model calls each, on a loaded 2-core CI
            "stall_timeout_s": 300,
        },
        sampling={"train": {"max_tokens": 16}, "eval": {"max_tokens": 16}},
    )
    result = UnifiedTrainer(config).fit()
    assert result.steps == 2 and result.metrics["episodes/errors"] == 0
    assert "eval/tool_use" in result.metrics, "the tool agent's eval counts its calls"
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    # In a step in which episodes ended (in async mode the last step may have none).
    assert any("rollout/tool_use" in json.loads(line) for line in lines), "and so does training"

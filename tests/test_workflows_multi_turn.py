"""Multi-turn workflows: turns, per-turn rewards, the turn limit, and steps that share prefixes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.agents import GuessingGame, ScriptedEngine
from unified.errors import WorkflowError
from unified.types import ModelOutput, Step, Task, Transcript
from workflows.multi_turn import Environment, MultiTurnWorkflow

TASK = Task(id="g", data={"target": 7})


def one_token_output() -> ModelOutput:
    return ModelOutput(
        text="a", prompt_ids=[1], completion_ids=[2], logprobs=[-1.0],
        finish_reason="stop", policy_version=0,
    )  # fmt: skip


class Guess(MultiTurnWorkflow):
    max_turns = 4

    def environment(self, task: Task) -> Environment:
        return GuessingGame()


async def test_each_turn_is_one_step_with_its_reward_and_the_trajectory_sums_them() -> None:
    trajectory = await Guess().run(TASK, ScriptedEngine(["3", "9", "7"]))
    assert [s.output.text for s in trajectory.steps] == ["3", "9", "7"]
    assert [s.reward for s in trajectory.steps] == [-0.1, -0.1, 1.0], "per-turn rewards"
    assert trajectory.reward == pytest.approx(0.8), "trajectory reward = sum of turn rewards"
    assert trajectory.steps[-1].info["done"] and not trajectory.steps[-1].info["truncated"]


async def test_each_step_holds_the_prompt_it_saw_including_earlier_observations() -> None:
    engine = ScriptedEngine(["3", "9", "7"])
    trajectory = await Guess().run(TASK, engine)
    third = trajectory.steps[2].messages
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in third] == ["guess a number", "3", "higher", "9", "lower"]
    assert list(third) == engine.prompts[2], "the step's messages are what the model was sent"
    assert len(trajectory.steps[0].messages) == 1, "a later turn never rewrites an earlier step"


async def test_an_episode_past_the_turn_limit_stops_and_is_marked_truncated() -> None:
    trajectory = await Guess().run(TASK, ScriptedEngine(["1", "2", "3", "4", "5"]))
    assert len(trajectory.steps) == 4, "max_turns bounds the model calls"
    assert trajectory.steps[-1].info["truncated"] and not trajectory.steps[-1].info["done"]
    assert trajectory.reward == pytest.approx(-0.4)


async def test_sampling_settings_can_change_per_turn() -> None:
    class ShortLastTurn(Guess):
        def sampling(self, turn: int) -> dict[str, Any]:
            return {"max_tokens": 2} if turn == self.max_turns - 1 else {}

    engine = ScriptedEngine(["1", "2", "3", "4"])
    await ShortLastTurn().run(TASK, engine)
    assert engine.sampling == [{}, {}, {}, {"max_tokens": 2}]


async def test_a_turn_limit_below_one_is_a_clear_error() -> None:
    class NoTurns(Guess):
        max_turns = 0

    with pytest.raises(WorkflowError, match=r"NoTurns.max_turns must be >= 1, got 0"):
        await NoTurns().run(TASK, ScriptedEngine([]))


def test_a_transcript_snapshot_is_unaffected_by_later_appends() -> None:
    transcript = Transcript([{"role": "user", "content": "hi"}])
    snapshot = transcript.snapshot()
    transcript.append({"role": "assistant", "content": "yo"})
    assert list(snapshot) == [{"role": "user", "content": "hi"}] and len(transcript) == 2
    with pytest.raises(TypeError, match="read-only"):
        snapshot.append({"role": "user", "content": "again"})


def test_a_step_given_a_transcript_shares_its_storage_instead_of_copying() -> None:
    transcript = Transcript([{"role": "user", "content": str(i)} for i in range(3)])
    step = Step(messages=transcript, output=one_token_output())
    transcript.append({"role": "assistant", "content": "late"})
    assert isinstance(step.messages, Transcript) and len(step.messages) == 3
    assert step.messages[0] is transcript[0], "shared, not copied"
    assert step.model_dump()["messages"] == [{"role": "user", "content": str(i)} for i in range(3)]
    assert copy.deepcopy(step).messages == step.messages


def test_a_step_given_a_list_still_copies_it() -> None:
    messages = [{"role": "user", "content": "hi"}]
    step = Step(messages=messages, output=one_token_output())
    messages[0]["content"] = "changed"
    assert step.messages == [{"role": "user", "content": "hi"}]


async def test_a_200_turn_episode_holds_each_message_once_not_once_per_step() -> None:
    class Long(Guess):
        max_turns = 200

    class Unrendered(ScriptedEngine):
        def encode_chat(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
            return [0]  # the chat template's cost is not what this test is about

    trajectory = await Long().run(TASK, Unrendered(["1"] * 200))
    held = {id(m) for step in trajectory.steps for m in step.messages}
    assert len(trajectory.steps) == 200
    assert len(held) == 2 * 200 - 1, f"steps share one transcript; {len(held)} message objects"

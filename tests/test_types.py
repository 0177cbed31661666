"""Data types validate what crosses a boundary and never alias a workflow's mutable state."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup


def output(n: int = 2, **kw: object) -> ModelOutput:
    fields: dict[str, object] = {
        "text": "ab",
        "prompt_ids": [1],
        "completion_ids": list(range(n)),
        "logprobs": [-0.5] * n,
        "finish_reason": "stop",
        "policy_version": 3,
    }
    fields.update(kw)
    return ModelOutput.model_validate(fields)


def test_step_copies_messages_so_later_appends_do_not_rewrite_it() -> None:
    messages = [{"role": "user", "content": "hi"}]
    step = Step(messages=messages, output=output())
    messages.append({"role": "assistant", "content": "yo"})
    messages[0]["content"] = "changed"
    assert step.messages == [{"role": "user", "content": "hi"}]


def test_model_output_rejects_logprobs_that_do_not_match_the_tokens() -> None:
    with pytest.raises(ValidationError, match="logprobs has 1 entries for 2"):
        output(logprobs=[-0.1])
    with pytest.raises(ValidationError, match="log-probabilities"):
        output(logprobs=[0.5, -0.1])


def test_oldest_version_spans_partial_rollout_token_versions() -> None:
    out = output(policy_version=5, token_versions=[4, 5])
    episode = Episode(
        task_id="t",
        rollout_index=0,
        policy_version=6,
        trajectories=[Trajectory(steps=[Step(output=out)], reward=1.0)],
    )
    assert episode.oldest_version == 4


def test_trajectory_rejects_a_nan_reward() -> None:
    with pytest.raises(ValidationError, match="finite"):
        Trajectory(steps=[], reward=float("nan"))


def test_group_needs_one_advantage_per_episode() -> None:
    episode = Episode(task_id="t", rollout_index=0)
    with pytest.raises(ValidationError, match="2 advantages for 1 episodes"):
        TrajectoryGroup(task_id="t", episodes=[episode], advantages=[0.0, 1.0], policy_version=0)


def test_trajectory_sequences_merge_calls_while_each_prompt_extends_the_last_call() -> None:
    def call(prompt: list[int], completion: list[int]) -> Step:
        return Step(output=output(len(completion), prompt_ids=prompt, completion_ids=completion))

    steps = [
        call([1, 2], [3]),
        call([1, 2, 3, 4], [5, 6]),  # the conversation so far plus an observation: same run
        Step(output=output(0)),  # no completion: nothing to train
        call([1, 2, 9, 4, 5, 6, 7], [8]),  # token 3 rewritten (a summarised history): new run
        call([1, 2, 9, 4, 5, 6, 7, 8], [0]),  # extends with no observation between
        call([1, 2], [3]),  # shorter than the run: new run
    ]
    runs = Trajectory(steps=steps, reward=0.0).sequences()
    assert [[o.completion_ids for o in run] for run in runs] == [[[3], [5, 6]], [[8], [0]], [[3]]]

"""Groups -> training sequences: the one contract every backend's loss reads."""

from __future__ import annotations

import re

import pytest

from unified.config import load_config
from unified.errors import CapabilityError, ConfigError
from unified.protocol import check_capabilities, create_backend
from unified.sequences import (
    TrainingSequence,
    fold_entropy_bonus,
    fold_kl_penalty,
    sampled_entropy,
    scoring_temperature,
    sequences_of,
)
from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup


def output(
    prompt: list[int],
    completion: list[int],
    *,
    temperature: float | None = None,
    version: int = 0,
    token_versions: list[int] | None = None,
) -> ModelOutput:
    return ModelOutput(
        text="",
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5 - i for i in range(len(completion))],
        finish_reason="stop",
        policy_version=version,
        token_versions=token_versions,
        temperature=temperature,
    )


def group(
    *trajectories: list[ModelOutput],
    advantages: list[float] | None = None,
    task: str = "t",
    group_id: str = "",
) -> TrajectoryGroup:
    advantages = advantages or [2.0] * len(trajectories)
    episodes = [
        Episode(
            task_id=task,
            rollout_index=i,
            trajectories=[Trajectory(steps=[Step(output=o) for o in steps], reward=float(i))],
        )
        for i, steps in enumerate(trajectories)
    ]
    return TrajectoryGroup(
        task_id=task, episodes=episodes, advantages=advantages, policy_version=0, group_id=group_id
    )


def test_a_call_becomes_its_prompt_then_its_sampled_completion() -> None:
    (seq,) = sequences_of([group([output([1, 2, 3], [7, 8])], advantages=[1.5])], loss="ppo")
    assert seq.tokens == [1, 2, 3, 7, 8]
    assert seq.mask == [False, False, False, True, True], "only completion tokens carry a loss"
    assert seq.logprobs == [0.0, 0.0, 0.0, -0.5, -1.5], "sampler logprobs, 0 off the mask"
    assert seq.advantages == [0.0, 0.0, 0.0, 1.5, 1.5], "the episode's advantage per token"
    assert seq.prompt_length == 3 and seq.sampled_count == 2


def test_turns_that_extend_the_history_merge_with_tool_tokens_masked_out() -> None:
    first = output([1, 2], [3, 4])
    second = output([1, 2, 3, 4, 20, 21], [5])  # the tool's reply (20 21), then the next turn
    (seq,) = sequences_of([group([first, second])], loss="ppo")
    assert seq.tokens == [1, 2, 3, 4, 20, 21, 5]
    assert seq.mask == [False, False, True, True, False, False, True]
    assert seq.advantages == [0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0]
    assert seq.logprobs[4:6] == [0.0, 0.0], "observations have no sampler logprob"


def test_a_turn_that_rewrites_the_history_starts_a_new_sequence_of_the_same_trajectory() -> None:
    a, b = sequences_of([group([output([1, 2], [3]), output([1, 7], [8])])], loss="ppo")
    assert (a.tokens, b.tokens) == ([1, 2, 3], [1, 7, 8])
    assert a.trajectory_id == b.trajectory_id == 0, "seq_mean_* weighs the trajectory once"


def test_ids_and_rewards_name_the_group_and_the_trajectory() -> None:
    groups = [
        group([output([1], [2])], [output([1], [3])], task="a", group_id="g-a"),
        group([output([4], [5])], task="b"),
    ]
    sequences = sequences_of(groups, loss="ppo")
    assert [s.trajectory_id for s in sequences] == [0, 1, 2]
    assert [s.group_id for s in sequences] == ["g-a", "g-a", "b"], "the task id without a group id"
    assert [s.task_id for s in sequences] == ["a", "a", "b"]
    assert [s.reward for s in sequences] == [0.0, 1.0, 0.0], "the trajectory's reward"


def test_versions_are_per_sampled_token() -> None:
    first = output([1], [2, 3], version=4, token_versions=[3, 4])
    second = output([1, 2, 3, 9], [5], version=5)
    (seq,) = sequences_of([group([first, second])], loss="ppo")
    assert seq.versions == [-1, 3, 4, -1, 5]


def test_tokens_are_scored_at_their_sampling_temperature_greedy_and_supervised_at_1() -> None:
    assert scoring_temperature(0.7, loss="ppo", default=1.0) == 0.7
    assert scoring_temperature(None, loss="ppo", default=0.5) == 0.5, "the run's train setting"
    assert scoring_temperature(0.0, loss="ppo", default=1.0) == 1.0, "greedy"
    assert scoring_temperature(0.7, loss="cross_entropy", default=1.0) == 1.0, "plain likelihood"
    (seq,) = sequences_of([group([output([1], [2], temperature=0.6)])], loss="ppo")
    assert seq.temperature == 0.6


def test_a_call_scored_at_another_temperature_starts_a_sequence_of_its_own() -> None:
    first = output([1, 2], [3, 4], temperature=1.0)
    second = output([1, 2, 3, 4, 20], [5], temperature=0.5)
    a, b = sequences_of([group([first, second])], loss="ppo")
    assert [(s.tokens, s.temperature) for s in (a, b)] == [
        ([1, 2, 3, 4], 1.0),
        ([1, 2, 3, 4, 20, 5], 0.5),
    ]
    assert b.mask == [False] * 5 + [True], "the earlier call is prompt of the new sequence"
    greedy = output([1, 2, 3, 4, 20], [5], temperature=0.0)
    (merged,) = sequences_of([group([first, greedy])], loss="ppo")
    assert merged.temperature == 1.0, "greedy and temperature 1 score alike: one sequence"
    (supervised,) = sequences_of([group([first, second])], loss="cross_entropy")
    assert supervised.temperature == 1.0


def test_the_kl_penalty_charges_tokens_likelier_than_the_reference() -> None:
    (seq,) = sequences_of([group([output([1, 2], [3, 4])], advantages=[1.0])], loss="ppo")
    # Sampler logprobs are -0.5, -1.5; the reference gives -1.5 and -1.5: KL 1.0 and 0.0.
    mean_kl = fold_kl_penalty([seq], [[None, -9.0, -1.5, -1.5]], coef=0.1)
    assert mean_kl == pytest.approx(0.5)
    assert seq.advantages == pytest.approx([0.0, 0.0, 1.0 - 0.05, 1.0 + 0.05])


def test_the_entropy_fold_is_an_explicit_argument_centred_over_the_batch() -> None:
    groups = [group([output([1], [3, 4])], advantages=[1.0]), group([output([1], [5])])]
    plain = sequences_of(groups, loss="ppo")
    assert [s.advantages for s in plain] == [[0.0, 1.0, 1.0], [0.0, 2.0]], "no fold by default"
    a, b = sequences_of(groups, loss="ppo", entropy_fold=0.3)
    # Sampler logprobs: -0.5, -1.5 (advantage 1) and -0.5 (advantage 2); mean -logprob 5/6.
    assert sampled_entropy([a, b]) == pytest.approx(2.5 / 3)
    bonus = [0.3 * (0.5 - 2.5 / 3), 0.3 * (1.5 - 2.5 / 3)]
    assert a.advantages == pytest.approx([0.0, 1.0 + bonus[0], 1.0 + bonus[1]])
    assert b.advantages == pytest.approx([0.0, 2.0 + bonus[0]])
    folded = [x - y for x, y in zip(a.advantages + b.advantages, [0, 1, 1, 0, 2], strict=True)]
    assert sum(folded) == pytest.approx(0.0), "centred: the bonus moves no mean advantage"


def test_the_entropy_bonus_adds_to_a_folded_kl_penalty() -> None:
    (seq,) = sequences_of([group([output([1, 2], [3, 4])], advantages=[1.0])], loss="ppo")
    fold_kl_penalty([seq], [[None, -9.0, -1.5, -1.5]], coef=0.1)
    assert fold_entropy_bonus([seq], coef=0.2) == pytest.approx(1.0)
    # KL: -0.05, +0.05; entropy (-logprob 0.5, 1.5, mean 1.0): -0.1, +0.1.
    assert seq.advantages == pytest.approx([0.0, 0.0, 1.0 - 0.15, 1.0 + 0.15])


def test_a_reference_of_the_wrong_length_is_refused() -> None:
    seq = TrainingSequence()
    seq.add_call(output([1], [2]), 1.0)
    with pytest.raises(ValueError, match="1 reference logprobs for 2 tokens"):
        fold_kl_penalty([seq], [[None]], coef=0.1)


@pytest.mark.parametrize(
    ("section", "old", "new"),
    [
        ("local", "micro_batch", "local.forward_batch_size"),
        ("local", "loss_agg", "trainer.loss_agg"),
        ("local", "betas", "trainer.optimizer.betas"),
        ("local", "max_grad_norm", "trainer.optimizer.max_grad_norm"),
        ("tinker", "loss_agg", "trainer.loss_agg"),
        ("tinker", "adam_beta2", "trainer.optimizer.betas"),
        ("tinker", "adam_eps", "trainer.optimizer.eps"),
        ("tinker", "grad_clip_norm", "trainer.optimizer.max_grad_norm"),
        ("verl", "micro_batch_size", "verl.forward_batch_size"),
        ("verl", "loss_agg", "trainer.loss_agg"),
        ("verl", "weight_decay", "trainer.optimizer.weight_decay"),
    ],
)
def test_a_moved_backend_key_is_one_line_naming_the_new_key(
    section: str, old: str, new: str
) -> None:
    config = load_config({"workflow": "x:y", "backend": section, section: {old: 1}})
    expected = rf"'{section}\.{old}' has moved: use {re.escape(new)}"
    with pytest.raises(ConfigError, match=expected) as e:
        check_capabilities(config, create_backend(section))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("backend", "knob", "message"),
    [
        ("tinker", "trainer.loss_agg=seq_mean_token_mean", "it supports: token_mean, token_sum"),
        ("local", "trainer.loss_agg=token_sum", "it supports: seq_mean_token_mean"),
        ("tinker", "sampling.train.temperature=0.7", "score tokens at temperature 1"),
        ("verl", "trainer.optimizer.max_grad_norm=null", "it always clips"),
    ],
)
def test_a_knob_the_backend_cannot_honour_is_refused(backend: str, knob: str, message: str) -> None:
    config = load_config({"workflow": "x:y", "backend": backend}, [knob])
    with pytest.raises(CapabilityError, match=message):
        check_capabilities(config, create_backend(backend))

"""Training sequences -> Tinker Datums: shift by one, multi-turn merging, folded advantages."""

from __future__ import annotations

import pytest

from backends.tinker.datums import to_datum
from unified.sequences import (
    TrainingSequence,
    fold_entropy_bonus,
    fold_kl_penalty,
    sequences_of,
)
from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup


def output(prompt: list[int], completion: list[int]) -> ModelOutput:
    logprobs = [-0.5 - i for i in range(len(completion))]
    return ModelOutput(
        text="", prompt_ids=prompt, completion_ids=completion, logprobs=logprobs,
        finish_reason="stop", policy_version=0,
    )  # fmt: skip


def group(*steps: ModelOutput, advantage: float = 2.0) -> TrajectoryGroup:
    trajectory = Trajectory(steps=[Step(output=o) for o in steps], reward=1.0)
    episode = Episode(task_id="t", rollout_index=0, trajectories=[trajectory])
    return TrajectoryGroup(
        task_id="t", episodes=[episode], advantages=[advantage], policy_version=0
    )


def group_sequences(groups: list[TrajectoryGroup]) -> list[TrainingSequence]:
    return sequences_of(groups, loss="ppo")


def test_a_datum_is_shifted_by_one_with_zeros_on_prompt_positions() -> None:
    (sequence,) = group_sequences([group(output([1, 2, 3], [7, 8]))])
    datum = to_datum(sequence, "ppo")
    assert datum.model_input.to_ints() == [1, 2, 3, 7], "input: all tokens but the last"
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [2, 3, 7, 8], "position i predicts token i + 1"
    assert inputs["advantages"] == [0.0, 0.0, 2.0, 2.0], "advantages on sampled tokens only"
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.5], "sampler logprobs on sampled tokens"
    assert set(inputs) == {"target_tokens", "advantages", "logprobs"}, "only the loss's keys"


def test_cross_entropy_datums_carry_weights_on_completion_tokens_only() -> None:
    (sequence,) = group_sequences([group(output([1, 2], [5, 6]))])
    inputs = to_datum(sequence, "cross_entropy", scale=0.5).loss_fn_inputs
    assert set(inputs) == {"target_tokens", "weights"}
    assert inputs["weights"].tolist() == [0.0, 0.5, 0.5]


def test_turns_that_extend_the_previous_prompt_merge_into_one_sequence() -> None:
    first = output([1, 2], [3, 4])
    second = output([1, 2, 3, 4, 9], [5])  # the tool's reply (9) then the next turn
    (merged,) = group_sequences([group(first, second)])
    assert merged.tokens == [1, 2, 3, 4, 9, 5]
    assert merged.mask == [False, False, True, True, False, True]


def test_a_turn_that_rewrites_the_history_starts_a_new_sequence() -> None:
    sequences = group_sequences([group(output([1, 2], [3]), output([1, 7], [8]))])
    assert [s.tokens for s in sequences] == [[1, 2, 3], [1, 7, 8]]


def test_a_datum_carries_the_folded_kl_penalty_and_entropy_bonus() -> None:
    (sequence,) = group_sequences([group(output([1, 2], [3, 4]), advantage=1.0)])
    fold_kl_penalty([sequence], [[None, -9.0, -1.5, -1.5]], coef=0.1)
    fold_entropy_bonus([sequence], coef=0.2)
    # KL: -0.05, +0.05; entropy (-logprob 0.5, 1.5, mean 1.0): -0.1, +0.1.
    assert to_datum(sequence, "ppo").loss_fn_inputs["advantages"].tolist() == pytest.approx(
        [0.0, 0.85, 1.15]
    )

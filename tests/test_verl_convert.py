"""verl backend, conversion: training sequences to verl's padded batch and its no-padding form."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_response_mask
from verl.workers.utils.padding import no_padding_2_padding

from backends.verl.convert import micro_batch_rows, to_batch, to_no_padding
from unified.sequences import TrainingSequence, sequences_of
from unified.types import Episode, ModelOutput, Step, Trajectory, TrajectoryGroup

PAD = 0


def output(prompt: list[int], completion: list[int]) -> ModelOutput:
    logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return ModelOutput(
        text="",
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        finish_reason="stop",
        policy_version=0,
    )


def group(
    task: str, trajectories: list[list[ModelOutput]], advantages: list[float]
) -> TrajectoryGroup:
    episodes = [
        Episode(
            task_id=task,
            rollout_index=i,
            trajectories=[Trajectory(steps=[Step(output=o) for o in steps], reward=float(i))],
        )
        for i, steps in enumerate(trajectories)
    ]
    return TrajectoryGroup(
        task_id=task,
        episodes=episodes,
        advantages=advantages,
        policy_version=0,
        group_id=f"g-{task}",
    )


def groups_to_rows(groups: list[TrajectoryGroup]) -> list[TrainingSequence]:
    return sequences_of(groups, loss="ppo")


def groups_to_batch(groups: list[TrajectoryGroup], **kw: Any) -> DataProto:
    return to_batch(groups_to_rows(groups), **kw)


def prompt_ids(row: TrainingSequence) -> list[int]:
    return row.tokens[: row.prompt_length]


def response_ids(row: TrainingSequence) -> list[int]:
    return row.tokens[row.prompt_length :]


def single_turn_groups() -> list[TrajectoryGroup]:
    return [
        group("a", [[output([5, 6, 7], [8, 9])], [output([5, 6, 7], [10])]], [1.0, -1.0]),
        group("b", [[output([11], [12, 13, 14])], [output([11], [15, 16])]], [0.5, -0.5]),
    ]


def test_single_turn_rows_are_left_padded_prompts_and_right_padded_responses() -> None:
    batch = groups_to_batch(single_turn_groups(), pad_token_id=PAD)
    t = batch.batch
    assert t["prompts"].tolist()[0] == [5, 6, 7], "the longest prompt fills its row"
    assert t["prompts"].tolist()[2] == [PAD, PAD, 11], "shorter prompts are left-padded"
    assert t["responses"].tolist()[1] == [10, PAD, PAD], "responses are right-padded"
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert t["position_ids"][2].tolist() == [0, 0, 0, 1, 2, 3], "positions count real tokens"
    assert list(batch.non_tensor_batch["uid"]) == ["g-a", "g-a", "g-b", "g-b"]


def test_response_mask_matches_verls_compute_response_mask_on_single_turn_data() -> None:
    batch = groups_to_batch(single_turn_groups(), pad_token_id=PAD)
    assert torch.equal(batch.batch["response_mask"], compute_response_mask(batch))


def test_rows_round_trip_to_the_original_tokens_logprobs_and_advantages() -> None:
    groups = single_turn_groups()
    batch = groups_to_batch(groups, pad_token_id=PAD)
    t = batch.batch
    outputs = [
        s.output for g in groups for e in g.episodes for tr in e.trajectories for s in tr.steps
    ]
    advantages = [a for g in groups for a in g.advantages]
    for b, (out, adv) in enumerate(zip(outputs, advantages, strict=True)):
        prompt = t["prompts"][b][t["attention_mask"][b, : t["prompts"].shape[1]].bool()]
        mask = t["response_mask"][b].bool()
        assert prompt.tolist() == out.prompt_ids
        assert t["responses"][b][mask].tolist() == out.completion_ids
        assert t["old_log_probs"][b][mask].tolist() == pytest.approx(out.logprobs)
        assert t["advantages"][b][mask].tolist() == pytest.approx([adv] * len(out.completion_ids))
        assert float(t["advantages"][b][~mask].abs().sum()) == 0.0, "no advantage off the mask"


def test_multi_turn_steps_merge_into_one_row_with_tool_tokens_masked_out() -> None:
    first = output([1, 2], [3, 4])
    # The second call's prompt is the first prompt, the reply, then tool tokens 20 21.
    second = output([1, 2, 3, 4, 20, 21], [5])
    rows = groups_to_rows([group("m", [[first, second]], [2.0])])
    assert len(rows) == 1, "a step that extends its predecessor joins its row"
    assert response_ids(rows[0]) == [3, 4, 20, 21, 5]
    assert rows[0].mask[2:] == [1, 1, 0, 0, 1], "tool tokens carry no loss"
    assert rows[0].logprobs[2:][2:4] == [0.0, 0.0]


def test_a_step_that_does_not_extend_the_conversation_starts_a_new_row() -> None:
    rows = groups_to_rows([group("m", [[output([1, 2], [3]), output([9, 9], [4])]], [1.0])])
    assert [prompt_ids(r) for r in rows] == [[1, 2], [9, 9]]


def test_a_call_sampled_at_another_temperature_starts_a_row_of_its_own() -> None:
    first = output([1, 2], [3, 4]).model_copy(update={"temperature": 1.0})
    second = output([1, 2, 3, 4, 20], [5]).model_copy(update={"temperature": 0.5})
    rows = groups_to_rows([group("m", [[first, second]], [1.0])])
    assert [(prompt_ids(r), r.temperature) for r in rows] == [
        ([1, 2], 1.0),
        ([1, 2, 3, 4, 20], 0.5),
    ]


def test_rows_added_for_data_parallel_padding_carry_no_loss() -> None:
    batch = groups_to_batch(
        single_turn_groups()[:1] + single_turn_groups()[1:], pad_token_id=PAD, multiple=3
    )
    assert len(batch) == 6 and batch.meta_info["real_rows"] == 4
    assert batch.batch["response_mask"][4:].sum() == 0, "padding rows are masked out"
    assert batch.batch["advantages"][4:].abs().sum() == 0


def test_padding_rows_spread_over_micro_batches_so_none_is_padding_only() -> None:
    """5 rows on 4 ranks at 2 rows a micro-batch: 3 loss-free rows, which at the batch's end
    made the last rank's micro-batch padding only (verl's metrics then averaged in its zeros)."""
    rows = groups_to_rows(single_turn_groups()) + groups_to_rows(single_turn_groups()[:1])[:1]
    batch = to_batch(rows, pad_token_id=PAD, multiple=8, micro_batch=2)
    real_BR = batch.batch["response_mask"].sum(dim=1) > 0
    assert real_BR.view(4, 2).any(dim=1).all(), f"a micro-batch of padding only: {real_BR}"
    positions = batch.meta_info["real_positions"]
    assert sorted(positions) == real_BR.nonzero().flatten().tolist()
    for row, position in zip(rows, positions, strict=True):
        n = len(response_ids(row))
        assert batch.batch["responses"][position, :n].tolist() == response_ids(row), "in order"


def test_no_padding_form_round_trips_through_verls_helpers() -> None:
    batch = groups_to_batch(single_turn_groups(), pad_token_id=PAD)
    td = to_no_padding(batch)
    assert td["input_ids"].is_nested, "verl's engine takes nested (jagged) input ids"
    lengths = td["input_ids"].offsets().diff().tolist()
    assert lengths == batch.batch["attention_mask"].sum(dim=1).tolist()
    # Model outputs at position i score token i+1: verl maps them back shifted by one, so the
    # input ids come back as each response token's predecessor.
    restored = no_padding_2_padding(td["input_ids"].float(), td)
    t = batch.batch
    predecessors = torch.cat([t["prompts"][:, -1:], t["responses"][:, :-1]], dim=1)
    mask = t["response_mask"].bool()
    assert torch.equal(restored[mask].long(), predecessors[mask])


def test_the_no_padding_form_prints_no_torch_fx_notice(caplog: pytest.LogCaptureFixture) -> None:
    from torch.fx import _symbolic_trace

    _symbolic_trace.is_fx_tracing_warning.cache_clear()  # torch logs it once per process
    with caplog.at_level(logging.WARNING):
        to_no_padding(groups_to_batch(single_turn_groups(), pad_token_id=PAD))
    assert not [r for r in caplog.records if r.name.startswith("torch.fx")], caplog.text


def test_micro_batches_shrink_for_a_small_batch() -> None:
    assert micro_batch_rows(6, 2, 8) == 3
    assert micro_batch_rows(64, 2, 8) == 8


@pytest.mark.parametrize(("rows", "dp", "most"), [(20, 2, 8), (21, 2, 8), (100, 2, 16), (7, 1, 4)])
def test_micro_batches_are_even_so_padding_fills_none(rows: int, dp: int, most: int) -> None:
    micro = micro_batch_rows(rows, dp, most)
    padded = -(-rows // (micro * dp)) * micro * dp
    assert micro <= most and padded - rows < dp * (padded // (micro * dp)), (micro, padded)
    last_rank_real = rows - (dp - 1) * (padded // dp)
    assert last_rank_real > (padded // dp) - micro, "the last rank's last micro-batch holds a row"

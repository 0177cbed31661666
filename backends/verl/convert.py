"""Trajectory groups -> verl's batch: the padded `DataProto`, and the no-padding form of workers.

One row per trajectory. A multi-turn trajectory whose every step's prompt extends the previous
step's prompt and completion (`Trajectory.sequences`) becomes one row: the first prompt, then a
response that interleaves model tokens (`response_mask` 1) with the tool/environment/template
tokens between model calls (`response_mask` 0); a step that does not extend its predecessor
starts a new row. The layout is that of verl's agent loops (`AgentLoopWorker._postprocess`):

- `prompts` [B, P] left-padded; `responses`, `response_mask` [B, R] right-padded;
- `input_ids` = prompts ++ responses, `attention_mask`, `position_ids` = cumsum(mask) - 1 [B, P+R];
- `old_log_probs` = `rollout_log_probs`: the sampler's log-probs, 0 where `response_mask` is 0;
- `advantages` [B, R]: the episode's advantage on model tokens; `token_level_rewards` [B, R]: the
  trajectory's reward on its last response token (what verl's estimators read);
- non-tensor `uid` (the group: verl's estimators group rows by it) and `task_id`.

Invariant: rows added to split evenly over data-parallel ranks and micro-batches copy a real row
with `response_mask` and `advantages` zeroed, so they carry no loss and no gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from unified.errors import BackendError
from unified.types import ModelOutput, TrajectoryGroup

__all__ = [
    "Row",
    "groups_to_batch",
    "groups_to_rows",
    "micro_batch_rows",
    "rows_to_batch",
    "to_no_padding",
]


@dataclass
class Row:
    """One sequence of the batch before padding: a prompt and a response with its per-token data."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    reward: float = 0.0
    uid: str = ""
    task_id: str = ""
    temperature: float | None = None

    def extend(self, out: ModelOutput) -> None:
        """Append a later call of the same run: the tokens between calls, then its completion."""
        between = list(out.prompt_ids[len(self.prompt_ids) + len(self.response_ids) :])
        self.response_ids += between + list(out.completion_ids)
        self.response_mask += [0] * len(between) + [1] * len(out.completion_ids)
        self.logprobs += [0.0] * len(between) + list(out.logprobs)


def groups_to_rows(groups: Sequence[TrajectoryGroup]) -> list[Row]:
    """The rows of `groups`, in group, episode, trajectory and run order."""
    rows: list[Row] = []
    for group in groups:
        uid = group.group_id or group.task_id
        for episode, advantage in zip(group.episodes, group.advantages, strict=True):
            for trajectory in episode.trajectories:
                for first, *later in trajectory.sequences():
                    start = functools.partial(
                        _row,
                        advantage=advantage,
                        reward=trajectory.reward,
                        uid=uid,
                        task_id=group.task_id,
                    )
                    row = start(first)
                    for out in later:
                        # A row is scored at one temperature: a call sampled at another starts
                        # its own (and the backend refuses a batch that mixes them).
                        if out.temperature != row.temperature:
                            rows.append(row)
                            row = start(out)
                        else:
                            row.extend(out)
                    rows.append(row)
    return rows


def _row(out: ModelOutput, *, advantage: float, reward: float, uid: str, task_id: str) -> Row:
    return Row(
        prompt_ids=list(out.prompt_ids),
        response_ids=list(out.completion_ids),
        response_mask=[1] * len(out.completion_ids),
        logprobs=list(out.logprobs),
        advantage=advantage,
        reward=reward,
        uid=uid,
        task_id=task_id,
        temperature=out.temperature,
    )


def rows_to_batch(
    rows: Sequence[Row], *, pad_token_id: int, multiple: int = 1, micro_batch: int | None = None
) -> DataProto:
    """Pad `rows` into verl's batch layout, with loss-free rows up to a multiple of `multiple`.

    verl splits the rows evenly over the data-parallel ranks and each rank's share into equal
    micro-batches: `multiple` is (data-parallel size) x (rows per micro-batch). Given
    `micro_batch`, the loss-free rows are spread one to a micro-batch from the last, so none is
    padding only (verl averages per-micro-batch metrics) unless micro-batches are one row;
    `meta_info["real_positions"]` says where each of `rows` went.
    """
    if not rows:
        raise BackendError("no trainable rows: every step of these groups has an empty completion")
    if any(not r.prompt_ids for r in rows):
        raise BackendError("a step has an empty prompt; verl cannot score its first token")
    B = len(rows)
    P = max(len(r.prompt_ids) for r in rows)
    R = max(len(r.response_ids) for r in rows)
    prompts_BP = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_mask_BP = torch.zeros(B, P, dtype=torch.long)
    responses_BR = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_valid_BR = torch.zeros(B, R, dtype=torch.long)
    response_mask_BR = torch.zeros(B, R, dtype=torch.long)
    logprobs_BR = torch.zeros(B, R, dtype=torch.float32)
    advantages_BR = torch.zeros(B, R, dtype=torch.float32)
    rewards_BR = torch.zeros(B, R, dtype=torch.float32)
    for b, row in enumerate(rows):
        p, n = len(row.prompt_ids), len(row.response_ids)
        prompts_BP[b, P - p :] = torch.tensor(row.prompt_ids)
        prompt_mask_BP[b, P - p :] = 1
        responses_BR[b, :n] = torch.tensor(row.response_ids)
        response_valid_BR[b, :n] = 1
        mask = torch.tensor(row.response_mask)
        response_mask_BR[b, :n] = mask
        logprobs_BR[b, :n] = torch.tensor(row.logprobs) * mask
        advantages_BR[b, :n] = row.advantage * mask
        rewards_BR[b, n - 1] = row.reward
    attention_mask = torch.cat([prompt_mask_BP, response_valid_BR], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts_BP,
            "responses": responses_BR,
            "response_mask": response_mask_BR,
            "input_ids": torch.cat([prompts_BP, responses_BR], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "rollout_log_probs": logprobs_BR,
            "old_log_probs": logprobs_BR.clone(),
            "advantages": advantages_BR,
            "token_level_rewards": rewards_BR,
        },
        non_tensors={
            "uid": np.array([r.uid for r in rows], dtype=object),
            "task_id": np.array([r.task_id for r in rows], dtype=object),
        },
    )
    padded, pad_size = pad_dataproto_to_divisor(batch, multiple)
    if pad_size:
        for key in ("response_mask", "advantages", "token_level_rewards"):
            padded.batch[key][B:] = 0
    order = _spread_padding(B, len(padded), micro_batch or len(padded))
    if order != list(range(len(padded))):
        padded.reorder(torch.tensor(order))
    padded.meta_info["real_rows"] = B
    padded.meta_info["real_positions"] = [p for p, row in enumerate(order) if row < B]
    return padded


def _spread_padding(real: int, total: int, micro_batch: int) -> list[int]:
    """The row order (new position -> old row) that moves the loss-free rows `real..total-1` to
    the ends of the micro-batches of `micro_batch` rows, one each from the last, then again."""
    blocks = total // micro_batch
    pad_at = set()
    for i in range(total - real):
        block, depth = blocks - 1 - i % blocks, i // blocks
        pad_at.add(block * micro_batch + micro_batch - 1 - depth)
    pads, reals = iter(range(real, total)), iter(range(real))
    return [next(pads) if position in pad_at else next(reals) for position in range(total)]


def groups_to_batch(
    groups: Sequence[TrajectoryGroup], *, pad_token_id: int, multiple: int = 1
) -> DataProto:
    """verl's padded batch for `groups` (rows as in `groups_to_rows`)."""
    return rows_to_batch(groups_to_rows(groups), pad_token_id=pad_token_id, multiple=multiple)


def micro_batch_rows(rows: int, dp_size: int, most: int) -> int:
    """Rows per micro-batch for `rows` over `dp_size` ranks: each rank's share split into as few
    micro-batches of at most `most` rows as it takes, all of one size, so that the batch pads by
    less than a row per micro-batch (20 rows on 2 ranks at most 8: 5, not 8 and 12 rows of
    padding, a whole micro-batch of them, which verl's per-micro-batch metrics would average)."""
    per_rank = -(-rows // dp_size)
    micro_batches = -(-per_rank // most)
    return max(1, -(-per_rank // micro_batches))


def to_no_padding(batch: DataProto, **non_tensors: object) -> TensorDict:
    """The no-padding (nested) TensorDict verl's engine workers take, with `non_tensors` set.

    As verl's trainer does before `infer_batch`/`train_mini_batch`: `to_tensordict`, then
    `left_right_2_no_padding` (nested `input_ids`/`position_ids`, `loss_mask` = `response_mask`).
    """
    td = left_right_2_no_padding(batch.to_tensordict())
    if non_tensors:
        tu.assign_non_tensor(td, **non_tensors)
    return td

"""Training sequences -> verl's batch: the padded `DataProto`, and the no-padding form of workers.

One row per `TrainingSequence` (`unified.sequences`: a run of a trajectory's model calls): the
first call's prompt, then a response that interleaves model tokens (`response_mask` 1) with the
tool/environment/template tokens between model calls (`response_mask` 0). The layout is that of
verl's agent loops (`AgentLoopWorker._postprocess`):

- `prompts` [B, P] left-padded; `responses`, `response_mask` [B, R] right-padded;
- `input_ids` = prompts ++ responses, `attention_mask`, `position_ids` = cumsum(mask) - 1 [B, P+R];
- `old_log_probs` = `rollout_log_probs`: the sampler's log-probs, 0 where `response_mask` is 0;
- `advantages` [B, R]: the sequence's advantages on model tokens; `token_level_rewards` [B, R]:
  the trajectory's reward on its last response token (what verl's estimators read);
- non-tensor `uid` (the group: verl's estimators group rows by it) and `task_id`.

Invariant: rows added to split evenly over data-parallel ranks and micro-batches copy a real row
with `response_mask` and `advantages` zeroed, so they carry no loss and no gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

from unified.errors import BackendError
from unified.sequences import TrainingSequence

__all__ = ["micro_batch_rows", "to_batch", "to_no_padding"]


def _not_the_fx_tracing_notice(record: logging.LogRecord) -> bool:
    return "is_fx_tracing will return true" not in record.getMessage()


# verl's no-padding layout builds jagged nested tensors, and torch.nested asks
# `torch.fx.is_fx_tracing`, which logs a notice about torch.export once per process: torch's
# own API note, nothing a user of this backend can act on, printed in the middle of a run.
logging.getLogger("torch.fx._symbolic_trace").addFilter(_not_the_fx_tracing_notice)


def to_batch(
    sequences: Sequence[TrainingSequence],
    *,
    pad_token_id: int,
    multiple: int = 1,
    micro_batch: int | None = None,
) -> DataProto:
    """Pad `sequences` into verl's rows, with loss-free rows up to a multiple of `multiple`.

    verl splits the rows evenly over the data-parallel ranks and each rank's share into equal
    micro-batches: `multiple` is (data-parallel size) x (rows per micro-batch). Given
    `micro_batch`, the loss-free rows are spread one to a micro-batch from the last, so none is
    padding only (verl averages per-micro-batch metrics) unless micro-batches are one row;
    `meta_info["real_positions"]` says where each of `sequences` went.
    """
    if not sequences:
        raise BackendError("no trainable rows: every step of these groups has an empty completion")
    if any(not seq.prompt_length for seq in sequences):
        raise BackendError("a step has an empty prompt; verl cannot score its first token")
    B = len(sequences)
    P = max(seq.prompt_length for seq in sequences)
    R = max(len(seq.tokens) - seq.prompt_length for seq in sequences)
    prompts_BP = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_mask_BP = torch.zeros(B, P, dtype=torch.long)
    responses_BR = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_valid_BR = torch.zeros(B, R, dtype=torch.long)
    response_mask_BR = torch.zeros(B, R, dtype=torch.long)
    logprobs_BR = torch.zeros(B, R, dtype=torch.float32)
    advantages_BR = torch.zeros(B, R, dtype=torch.float32)
    rewards_BR = torch.zeros(B, R, dtype=torch.float32)
    for b, seq in enumerate(sequences):
        p = seq.prompt_length
        n = len(seq.tokens) - p
        prompts_BP[b, P - p :] = torch.tensor(seq.tokens[:p])
        prompt_mask_BP[b, P - p :] = 1
        responses_BR[b, :n] = torch.tensor(seq.tokens[p:])
        response_valid_BR[b, :n] = 1
        mask = torch.tensor(seq.mask[p:], dtype=torch.long)
        response_mask_BR[b, :n] = mask
        logprobs_BR[b, :n] = torch.tensor(seq.logprobs[p:]) * mask
        advantages_BR[b, :n] = torch.tensor(seq.advantages[p:]) * mask
        rewards_BR[b, n - 1] = seq.reward
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
            "uid": np.array([seq.group_id for seq in sequences], dtype=object),
            "task_id": np.array([seq.task_id for seq in sequences], dtype=object),
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

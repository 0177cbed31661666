"""Scoring target tokens under a model: the logprobs (and entropies) a loss differentiates.

One implementation for the local backend and the Tinker-compatible server. A batch is rows of
token ids, right-padded; target `t` is scored at row `rows_T[t]`, position `positions_T[t]` (the
position whose logits predict it), with those logits divided by the target's temperature when
one is given. Only the scored positions reach the log-softmax, so padding costs no softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TokenScores", "score_tokens"]


class TokenScores(NamedTuple):
    """A model's view of the target tokens, flattened in target order."""

    logp_T: torch.Tensor  # of each target token
    entropy_T: torch.Tensor  # of the distribution at its position; zeros unless asked for
    log_probs_TV: torch.Tensor  # over the vocabulary, at each target's position


def score_tokens(
    model: torch.nn.Module,
    ids_BL: torch.Tensor,
    rows_T: torch.Tensor,
    positions_T: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    temperatures_T: torch.Tensor | None = None,
    attention_mask_BL: torch.Tensor | None = None,
    with_entropy: bool = False,
) -> TokenScores:
    """Score `targets_T` under `model` run on `ids_BL` (all tensors on the model's device).

    Without `attention_mask_BL` the rows must be right-padded: under causal attention no real
    token sees a pad, and attention takes its faster causal path.
    """
    if attention_mask_BL is None:
        logits_BLV = model(input_ids=ids_BL).logits
    else:
        logits_BLV = model(input_ids=ids_BL, attention_mask=attention_mask_BL).logits
    # One gather for every target: per-row slicing would add autograd nodes per row.
    picked_TV = logits_BLV[rows_T, positions_T].float()
    if temperatures_T is not None:
        picked_TV = picked_TV / temperatures_T[:, None]
    log_probs_TV = torch.log_softmax(picked_TV, -1)
    logp_T = log_probs_TV.gather(1, targets_T[:, None])[:, 0]
    if with_entropy:
        entropy_T = -(log_probs_TV.exp() * log_probs_TV).sum(-1)
    else:
        entropy_T = torch.zeros_like(logp_T)
    return TokenScores(logp_T, entropy_T, log_probs_TV)

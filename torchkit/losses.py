"""Policy losses, per token, with their aggregation (the local backend's, the Tinker server's).

Every loss is a function of the trainer's log-probabilities `logp_T` (with gradient), the
sampler's `old_logp_T` and the advantages `adv_T`, one entry per completion token:

- `cross_entropy`:        -logp                                   (supervised; ignores advantages)
- `importance_sampling`:  -exp(logp - old) * A                    (REINFORCE, off-policy corrected)
- `ppo`:                  -min(r A, clip(r, 1-e, 1+e) A)          (clipped ratio; safe for async)
- `cispo`:                -sg(clip(r, 1-e, 1+e)) * A * logp       (clipped, stop-gradient IS weight)

With `r = exp(logp - old)`. At r = 1 `ppo` equals `importance_sampling` in value and gradient.
Optional terms: `kl_coef * KL` to the reference (k3 on the sampled token, or exact over the
vocabulary: `full_kl`, `forward_kl`) and `-entropy_coef * entropy`.

Truncated importance sampling (`tis_cap`, the decoupled objective of AReaL): the ratio of each
loss is taken against the proximal policy `prox = sg(logp)`, the trainer's own logprob before
this optimizer step, and each token's loss is weighted by `w = min(exp(prox - old), tis_cap)`
(no gradient), which corrects for the sampler's older (or mixed) versions:

- `importance_sampling`:  -w * exp(logp - prox) * A
- `ppo`:                  -w * min(r' A, clip(r', 1-e, 1+e) A)   with r' = exp(logp - prox)
- `cispo`:                -w * sg(clip(r', 1-e, 1+e)) * A * logp

One optimizer step per batch makes `r' = 1` in value, so all three give the gradient
`-w * A * grad(logp)`: the cap, not the clip, bounds how far a stale token pulls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LossAggregation",
    "LossTerms",
    "forward_kl",
    "full_kl",
    "kl_penalty",
    "per_token_loss",
    "token_weights",
]

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@dataclass
class LossTerms:
    """Per-token loss and the statistics the backend reports.

    `ratio_T` is `exp(logp - old)` (trainer over sampler); `is_weight_T` and `is_capped_T` are the
    truncated IS weights and where the cap bound, both None without `tis_cap`.
    """

    loss_T: torch.Tensor
    clipped_T: torch.Tensor
    ratio_T: torch.Tensor
    is_weight_T: torch.Tensor | None = None
    is_capped_T: torch.Tensor | None = None


def per_token_loss(
    loss: str,
    logp_T: torch.Tensor,
    old_logp_T: torch.Tensor,
    adv_T: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    tis_cap: float | None = None,
) -> LossTerms:
    """The policy loss of each token (before KL, entropy and aggregation)."""
    ratio_T = torch.exp(logp_T - old_logp_T)
    is_weight_T = is_capped_T = None
    anchor_T = old_logp_T
    if tis_cap is not None and loss != "cross_entropy":
        anchor_T = logp_T.detach()
        raw_T = ratio_T.detach()  # exp(prox - old): prox is logp's value
        is_weight_T = raw_T.clamp(max=tis_cap)
        is_capped_T = raw_T > tis_cap
        ratio_T = torch.exp(logp_T - anchor_T)
    low, high = 1.0 - clip_ratio, 1.0 + clip_ratio
    clipped_T = torch.zeros_like(adv_T, dtype=torch.bool)
    if loss == "cross_entropy":
        loss_T = -logp_T
    elif loss == "importance_sampling":
        loss_T = -ratio_T * adv_T
    elif loss == "ppo":
        unclipped_T = ratio_T * adv_T
        clipped_obj_T = ratio_T.clamp(low, high) * adv_T
        loss_T = -torch.minimum(unclipped_T, clipped_obj_T)
        clipped_T = clipped_obj_T < unclipped_T
    elif loss == "cispo":
        weight_T = ratio_T.detach().clamp(low, high)
        loss_T = -weight_T * adv_T * logp_T
        clipped_T = (ratio_T.detach() < low) | (ratio_T.detach() > high)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    if is_weight_T is not None:
        loss_T = is_weight_T * loss_T
    return LossTerms(
        loss_T=loss_T,
        clipped_T=clipped_T,
        ratio_T=torch.exp(logp_T.detach() - old_logp_T),
        is_weight_T=is_weight_T,
        is_capped_T=is_capped_T,
    )


KL_LOG_RATIO_CLAMP = 20.0
"""With a value clamp, the log ratio is clamped to +-20 first, as verl's `low_var_kl` does."""


def kl_penalty(
    logp_T: torch.Tensor, ref_logp_T: torch.Tensor, clamp: float | None = None
) -> torch.Tensor:
    """k3(ref || train) per token: exp(ref - logp) - (ref - logp) - 1, >= 0; on tokens the policy
    samples its value is unbiased for KL(train || ref), its gradient for KL(ref || train)'s
    (`forward_kl`).

    `clamp=10` is verl's `low_var_kl` (log ratio to +-20, value to at most 10): no token's pull
    exceeds ~13 times a policy-gradient token's, but past that ratio the pull back to the
    reference stops. Unclamped (default), the single-turn countdown keeps its entropy; clamped,
    it collapses onto one answer, while the tool agent keeps its format (docs/benchmarks.md).
    """
    log_ratio_T = ref_logp_T - logp_T
    if clamp is None:
        return torch.exp(log_ratio_T) - log_ratio_T - 1
    log_ratio_T = log_ratio_T.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio_T) - log_ratio_T - 1).clamp(max=clamp)


def full_kl(
    log_probs_TV: torch.Tensor, ref_log_probs_TV: torch.Tensor, clamp: float | None = None
) -> torch.Tensor:
    """KL(train || ref) per token, exactly, over the whole vocabulary: sum_v p_v (log p_v - ref_v).

    `kl_penalty` sees only the sampled token, so mass the policy moves onto tokens it rarely
    samples (a slipped character in a call's fixed text) goes unpenalised while an entropy bonus,
    computed over the vocabulary, pushes it there; this sees it. `clamp` caps each token's value.
    """
    kl_T = (log_probs_TV.exp() * (log_probs_TV - ref_log_probs_TV)).sum(-1)
    return kl_T if clamp is None else kl_T.clamp(max=clamp)


def forward_kl(
    log_probs_TV: torch.Tensor, ref_log_probs_TV: torch.Tensor, clamp: float | None = None
) -> torch.Tensor:
    """KL(ref || train) per token, exactly, over the vocabulary: sum_v ref_v (ref_v - log p_v).

    Its gradient on the logits is `p - ref`: the mean of `kl_penalty`'s gradient (unclamped) on
    tokens the policy samples now (k3's there is `(1 - ref/p) grad log p`, whose mean under p is
    that; stale tokens and a clamp move it off), without
    k3's variance, where a rare token the policy has all but dropped (ref/p in the hundreds)
    takes a whole clipped step. The same mean pull is not the same run: on the single-turn
    countdown k3's rare large pulls keep more answer patterns alive (docs/notes/
    2026-12-countdown-floor.md). `clamp` caps each token's value.
    """
    return full_kl(ref_log_probs_TV, log_probs_TV, clamp)  # the same KL, its sides swapped


def token_weights(
    lengths: list[int], mode: LossAggregation, sequences: list[int] | None = None
) -> tuple[torch.Tensor, float]:
    """Per-token weights of a batch of samples and the batch's normaliser.

    `lengths[i]` counts sample i's completion tokens; `sequences[i]` names the sequence it belongs
    to (default: its own). The `seq_mean_*` modes weight sequences, not samples, equally: give the
    model calls of one trajectory one sequence id, as verl's and Tinker's merged multi-turn rows
    do. Otherwise an episode that fails through three turns outweighs one solved in one, and a
    group's advantages, which sum to zero, push its sampled tokens down on balance.

    The backend sums `weight * loss` over every token of every `forward_backward` call and
    divides the gradient by the summed normaliser at `optim_step`, so the aggregate is exact
    however a step's groups were split across calls.
    """
    if sequences is None:
        sequences = list(range(len(lengths)))
    if len(sequences) != len(lengths):
        raise ValueError(f"{len(sequences)} sequence ids for {len(lengths)} samples")
    totals: dict[int, int] = {}
    for sequence, n in zip(sequences, lengths, strict=True):
        totals[sequence] = totals.get(sequence, 0) + n
    if mode == "token_mean":
        weights = [torch.ones(n) for n in lengths]
        return _cat(weights), float(sum(lengths))
    if mode == "seq_mean_token_mean":
        weights = [
            torch.full((n,), 1.0 / max(1, totals[sequence]))
            for sequence, n in zip(sequences, lengths, strict=True)
        ]
        return _cat(weights), float(len(totals))
    if mode == "seq_mean_token_sum":
        weights = [torch.ones(n) for n in lengths]
        return _cat(weights), float(len(totals))
    raise ValueError(f"unknown loss aggregation {mode!r}")


def _cat(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(weights) if weights else torch.zeros(0)

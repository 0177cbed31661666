"""Trajectory groups -> Tinker `Datum`s; the KL penalty and entropy bonus fold into advantages.

Shift by one: a sequence of tokens `s` becomes `model_input = s[:-1]`, `target_tokens = s[1:]`,
so input position i predicts token i+1, and every loss input has one entry per input position:
the sampler's `logprobs` and the `advantages` on sampled tokens, zeros on prompt (and tool
observation) tokens. The steps of one trajectory merge into one sequence while each step's prompt
extends the previous prompt plus completion (`Trajectory.sequences`); otherwise a new one starts.
Only the keys the loss takes are sent (`target_tokens` + `weights` for cross_entropy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import tinker

from unified.types import Trajectory, TrajectoryGroup

__all__ = ["TokenSequence", "fold_entropy_bonus", "fold_kl_penalty", "group_sequences", "to_datum"]


@dataclass
class TokenSequence:
    """Tokens of merged steps, which of them were sampled, their sampler logprobs and advantage."""

    tokens: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    advantage: float = 0.0
    advantages: list[float] | None = None
    """Per-token advantages, once a penalty or bonus is folded in (else `advantage` everywhere)."""

    def extend(self, tokens: Sequence[int], logprobs: Sequence[float] | None) -> None:
        """Append observed tokens (`logprobs` None) or sampled ones."""
        self.tokens += tokens
        self.sampled += [logprobs is not None] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)

    @property
    def sampled_count(self) -> int:
        """How many tokens the policy sampled (the tokens that carry a loss)."""
        return sum(self.sampled)


def trajectory_sequences(trajectory: Trajectory, advantage: float) -> list[TokenSequence]:
    """The trajectory's calls as merged sequences (one per run of `Trajectory.sequences`)."""
    sequences: list[TokenSequence] = []
    for run in trajectory.sequences():
        current = TokenSequence(advantage=advantage)
        for out in run:
            current.extend(out.prompt_ids[len(current.tokens) :], None)
            current.extend(out.completion_ids, out.logprobs)
        sequences.append(current)
    return sequences


def group_sequences(groups: Sequence[TrajectoryGroup]) -> list[TokenSequence]:
    """Every trainable sequence of `groups`, each carrying its episode's advantage."""
    return [
        sequence
        for group in groups
        for episode, advantage in zip(group.episodes, group.advantages, strict=True)
        for trajectory in episode.trajectories
        for sequence in trajectory_sequences(trajectory, advantage)
    ]


def fold_kl_penalty(
    sequences: Sequence[TokenSequence], reference: Sequence[Sequence[float | None]], coef: float
) -> float:
    """Add `coef * (mean_kl - kl_t)` to each sampled token's advantage; the mean KL.

    `kl_t = sampler logprob - reference logprob` of sampled token t (the tinker-cookbook's
    penalty): tokens the policy made likelier than the reference pay, the batch mean is returned.
    `reference[i][j]` is the reference logprob of `sequences[i].tokens[j]` (None at j = 0).
    """
    kls: list[list[float]] = []
    for seq, ref in zip(sequences, reference, strict=True):
        if len(ref) != len(seq.tokens):
            raise ValueError(f"{len(ref)} reference logprobs for {len(seq.tokens)} tokens")
        pairs = zip(seq.logprobs, ref, seq.sampled, strict=True)
        kls.append([q - (r or 0.0) if s else 0.0 for q, r, s in pairs])
    return _fold_penalty(sequences, kls, coef)


def fold_entropy_bonus(sequences: Sequence[TokenSequence], coef: float) -> float:
    """Add `coef * (-logprob_t - mean)` to each sampled token's advantage; the mean `-logprob`.

    A sampled estimate of the entropy bonus's gradient (REINFORCE with `-log p` as the reward;
    centring is the baseline), for losses that have no entropy term. The sampler logprobs are at
    temperature 1, so the returned mean estimates the policy's entropy in nats per token.
    """
    return -_fold_penalty(sequences, [seq.logprobs for seq in sequences], coef)


def _fold_penalty(
    sequences: Sequence[TokenSequence], values: Sequence[Sequence[float]], coef: float
) -> float:
    """Add `coef * (mean - v_t)` to each sampled token's advantage; the mean of `v` over them."""
    pairs = zip(sequences, values, strict=True)
    total = sum(v for seq, row in pairs for v, s in zip(row, seq.sampled, strict=True) if s)
    mean = total / max(1, sum(seq.sampled_count for seq in sequences))
    for seq, row in zip(sequences, values, strict=True):
        current = seq.advantages or [seq.advantage] * len(seq.tokens)
        seq.advantages = [
            a + coef * (mean - v) if s else 0.0
            for a, v, s in zip(current, row, seq.sampled, strict=True)
        ]
    return mean


def to_datum(sequence: TokenSequence, loss_fn: str, scale: float = 1.0) -> tinker.Datum:
    """The shifted-by-one `Datum` of a sequence; loss inputs are multiplied by `scale`."""
    tokens = sequence.tokens
    sampled = np.asarray(sequence.sampled[1:], dtype=np.float32)
    inputs: dict[str, np.ndarray | list[int]] = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = sampled * scale
    else:
        per_token = sequence.advantages or [sequence.advantage] * len(tokens)
        advantages = np.asarray(per_token[1:], dtype=np.float32) * sampled
        inputs["advantages"] = advantages * scale
        inputs["logprobs"] = np.asarray(sequence.logprobs[1:], dtype=np.float32) * sampled
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=inputs,  # type: ignore[arg-type]
    )

"""Trajectory groups -> the sequences every backend trains on: what exactly the loss sees.

A `TrainingSequence` is one forward pass: `tokens`, and per token whether the policy sampled it
(`mask`), the sampler's logprob, the advantage and the policy version. Invariant: every per-token
list has one entry per token, and off the mask (prompt, tool and environment tokens) `logprobs`
and `advantages` are 0 and `versions` -1. Backends only change the layout (local: right-padded
rows; tinker: shifted-by-one `Datum`s; verl: prompt/response rows); none re-derives the data.

- Runs: a trajectory's model calls merge into one sequence while each call's prompt extends the
  previous call's prompt and completion (`Trajectory.sequences`), so a multi-turn episode costs its
  length, not the sum of its prompts; a call that rewrites the history starts a new sequence.
- Scoring temperature: a token is scored at the temperature it was sampled under (the call's,
  else `sampling.train.temperature`); greedy (0) and the supervised loss score at 1. A sequence
  has one: a call scored at another starts a sequence of its own (`scoring_temperature`).
- Advantages: the episode's advantage on every sampled token. A backend whose loss has no KL or
  entropy term folds them into the advantages instead (`fold_kl_penalty`, and
  `sequences_of(..., entropy_fold=coef)`: the tinker-cookbook's approach).
- `trajectory_id` numbers the trajectories of one `sequences_of` call: the `seq_mean_*`
  aggregations weigh each trajectory once, however many sequences it took.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from unified.types import ModelOutput, Trajectory, TrajectoryGroup

__all__ = [
    "TrainingSequence",
    "fold_entropy_bonus",
    "fold_kl_penalty",
    "sampled_entropy",
    "scoring_temperature",
    "sequences_of",
]


@dataclass
class TrainingSequence:
    """One trainable token sequence: a run of a trajectory's model calls, with per-token data."""

    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    """True where the policy sampled the token (it carries a loss)."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's logprob of each sampled token (0 elsewhere)."""
    advantages: list[float] = field(default_factory=list)
    """Per sampled token: the episode's advantage, plus any folded penalty (0 elsewhere)."""
    versions: list[int] = field(default_factory=list)
    """The policy version each sampled token came from (-1 elsewhere)."""
    prompt_length: int = 0
    """Tokens before the first sampled one: the first call's prompt."""
    temperature: float = 1.0
    """The temperature the loss scores every token at."""
    group_id: str = ""
    """The group's id (its task id when it has none): group baselines compare within it."""
    task_id: str = ""
    trajectory_id: int = 0
    """The trajectory's number within one `sequences_of` call."""
    reward: float = 0.0
    """The trajectory's reward."""

    @property
    def sampled_count(self) -> int:
        """How many tokens the policy sampled (the tokens that carry a loss)."""
        return sum(self.mask)

    def add_call(self, out: ModelOutput, advantage: float) -> None:
        """Append a call of this run: the tokens since the last call (observed), then its
        completion (sampled)."""
        observed = out.prompt_ids[len(self.tokens) :]
        completion = out.completion_ids
        if not self.tokens:
            self.prompt_length = len(observed)
        versions = out.token_versions or [out.policy_version] * len(completion)
        self.tokens += [*observed, *completion]
        self.mask += [False] * len(observed) + [True] * len(completion)
        self.logprobs += [0.0] * len(observed) + list(out.logprobs)
        self.advantages += [0.0] * len(observed) + [advantage] * len(completion)
        self.versions += [-1] * len(observed) + list(versions)


def scoring_temperature(sampled_at: float | None, *, loss: str, default: float | None) -> float:
    """The temperature the loss scores a call's tokens at: the one they were sampled under
    (`sampled_at`, else `default`, the run's `sampling.train.temperature`), greedy at 1;
    the supervised loss (`cross_entropy`) scores plain likelihood, at 1."""
    if loss == "cross_entropy":
        return 1.0
    temperature = sampled_at if sampled_at is not None else default
    return temperature if temperature and temperature > 0 else 1.0


def sequences_of(
    groups: Sequence[TrajectoryGroup],
    *,
    loss: str,
    temperature: float | None = 1.0,
    entropy_fold: float | None = None,
) -> list[TrainingSequence]:
    """Every trainable sequence of `groups`, in group, episode, trajectory and run order.

    `loss` and `temperature` (`sampling.train.temperature`, for calls that do not say theirs)
    decide the scoring temperature. `entropy_fold`: the entropy bonus's coefficient, for a
    backend whose loss has no entropy term: it is folded into the advantages
    (`fold_entropy_bonus`); None leaves them as they are.
    """
    sequences: list[TrainingSequence] = []
    trajectory_id = 0
    for group in groups:
        for episode, advantage in zip(group.episodes, group.advantages, strict=True):
            for trajectory in episode.trajectories:
                sequences += _trajectory_sequences(
                    trajectory, advantage, group, trajectory_id, loss, temperature
                )
                trajectory_id += 1
    if entropy_fold is not None:
        fold_entropy_bonus(sequences, entropy_fold)
    return sequences


def _trajectory_sequences(
    trajectory: Trajectory,
    advantage: float,
    group: TrajectoryGroup,
    trajectory_id: int,
    loss: str,
    default: float | None,
) -> list[TrainingSequence]:
    sequences: list[TrainingSequence] = []
    for run in trajectory.sequences():
        current: TrainingSequence | None = None
        for out in run:
            temperature = scoring_temperature(out.temperature, loss=loss, default=default)
            if current is None or temperature != current.temperature:
                # A sequence is scored at one temperature: a call scored at another starts one.
                current = TrainingSequence(
                    temperature=temperature,
                    group_id=group.group_id or group.task_id,
                    task_id=group.task_id,
                    trajectory_id=trajectory_id,
                    reward=trajectory.reward,
                )
                sequences.append(current)
            current.add_call(out, advantage)
    return sequences


def fold_kl_penalty(
    sequences: Sequence[TrainingSequence],
    reference: Sequence[Sequence[float | None]],
    coef: float,
) -> float:
    """Add `coef * (mean_kl - kl_t)` to each sampled token's advantage; the mean KL.

    For a backend whose loss has no KL term. `kl_t = sampler logprob - reference logprob` of
    sampled token t (the tinker-cookbook's penalty): tokens the policy made likelier than the
    reference pay. `reference[i][j]` is the reference logprob of `sequences[i].tokens[j]`
    (None at j = 0).
    """
    kls: list[list[float]] = []
    for seq, ref in zip(sequences, reference, strict=True):
        if len(ref) != len(seq.tokens):
            raise ValueError(f"{len(ref)} reference logprobs for {len(seq.tokens)} tokens")
        pairs = zip(seq.logprobs, ref, seq.mask, strict=True)
        kls.append([q - (r or 0.0) if s else 0.0 for q, r, s in pairs])
    return _fold_penalty(sequences, kls, coef)


def fold_entropy_bonus(sequences: Sequence[TrainingSequence], coef: float) -> float:
    """Add `coef * (-logprob_t - mean)` to each sampled token's advantage; the mean `-logprob`.

    A sampled estimate of the entropy bonus's gradient (REINFORCE with `-log p` as the reward;
    centring is the baseline), for losses that have no entropy term.
    """
    return -_fold_penalty(sequences, [seq.logprobs for seq in sequences], coef)


def sampled_entropy(sequences: Sequence[TrainingSequence]) -> float:
    """The mean `-logprob` of the sampled tokens: sampled at temperature 1, an estimate of the
    policy's entropy in nats per token."""
    total = sum(-lp for seq in sequences for lp, s in zip(seq.logprobs, seq.mask, strict=True) if s)
    return total / max(1, sum(seq.sampled_count for seq in sequences))


def _fold_penalty(
    sequences: Sequence[TrainingSequence], values: Sequence[Sequence[float]], coef: float
) -> float:
    """Add `coef * (mean - v_t)` to each sampled token's advantage; the mean of `v` over them."""
    pairs = zip(sequences, values, strict=True)
    total = sum(v for seq, row in pairs for v, s in zip(row, seq.mask, strict=True) if s)
    mean = total / max(1, sum(seq.sampled_count for seq in sequences))
    for seq, row in zip(sequences, values, strict=True):
        seq.advantages = [
            a + coef * (mean - v) if s else 0.0
            for a, v, s in zip(seq.advantages, row, seq.mask, strict=True)
        ]
    return mean

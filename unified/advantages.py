"""Group baselines: turn the rewards of one group's rollouts into one advantage per rollout.

Every estimator is a pure function of the group's rewards (one float per episode, in episode
order) and returns a list of the same length and order. Pure Python on `math.fsum`, so the result
is the same on every backend and does not depend on the order of summation. A group whose rewards
are all equal gets exactly zero advantages from every estimator that has a baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

__all__ = [
    "ESTIMATORS",
    "AdvantageFn",
    "compute_advantages",
    "dr_grpo",
    "grpo",
    "max_variance_subset",
    "reinforce",
    "rloo",
]

AdvantageFn = Callable[[Sequence[float]], list[float]]

# Keeps a group with a tiny reward spread from blowing up its advantages.
_STD_EPS = 1e-6


def _all_equal(rewards: Sequence[float]) -> bool:
    return max(rewards) == min(rewards)


def _mean(rewards: Sequence[float]) -> float:
    return math.fsum(rewards) / len(rewards)


def grpo(rewards: Sequence[float]) -> list[float]:
    """GRPO: `(r - mean) / (std + 1e-6)` with the population std of the group."""
    if not rewards:
        return []
    if _all_equal(rewards):
        return [0.0] * len(rewards)
    mean = _mean(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + _STD_EPS) for r in rewards]


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO: `r - mean`, without the std normalisation that biases towards easy groups."""
    if not rewards:
        return []
    if _all_equal(rewards):
        return [0.0] * len(rewards)
    mean = _mean(rewards)
    return [r - mean for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    """REINFORCE leave-one-out: `r_i` minus the mean of the other rewards; a lone rollout gets 0."""
    n = len(rewards)
    if n <= 1 or _all_equal(rewards):
        return [0.0] * n
    total = math.fsum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def reinforce(rewards: Sequence[float]) -> list[float]:
    """Plain REINFORCE: the reward itself, no baseline."""
    return [float(r) for r in rewards]


ESTIMATORS: Mapping[str, AdvantageFn] = MappingProxyType(
    {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce": reinforce}
)


def compute_advantages(name: str, rewards: Sequence[float]) -> list[float]:
    """Advantages of one group by the estimator `name` (a key of `ESTIMATORS`, as in config).

    Raises `ValueError` for an unknown name (listing the valid ones) or a non-finite reward.
    """
    estimator = ESTIMATORS.get(name)
    if estimator is None:
        valid = ", ".join(sorted(ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {valid}")
    if not rewards:
        return []
    bad = [r for r in rewards if not math.isfinite(r)]
    if bad:
        raise ValueError(f"rewards must be finite numbers, got {bad[0]} in {list(rewards)}")
    return estimator(rewards)


def max_variance_subset(rewards: Sequence[float], k: int) -> list[int]:
    """Indices of the `k` rewards whose variance is largest, in index order.

    Max-variance down-sampling (PODS, Xu et al. 2025): the best subset is always some of the
    lowest rewards and the rest of the highest, so it is found among `k + 1` candidates.
    """
    if k >= len(rewards):
        return list(range(len(rewards)))
    order = sorted(range(len(rewards)), key=lambda i: rewards[i])
    best: tuple[float, list[int]] | None = None
    for low in range(k + 1):
        pick = order[:low] + order[len(order) - (k - low) :]
        values = [rewards[i] for i in pick]
        mean = math.fsum(values) / k
        spread = math.fsum((v - mean) ** 2 for v in values)
        if best is None or spread > best[0]:
            best = (spread, pick)
    assert best is not None
    return sorted(best[1])

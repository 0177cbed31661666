"""Group baselines: each estimator on a hand-computed group, and the invariants they share."""

from __future__ import annotations

import itertools
import math
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unified.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo,
    grpo,
    max_variance_subset,
    reinforce,
    rloo,
)
from unified.config import TrainerSection, check_rl_groups, load_config
from unified.errors import ConfigError

# Mean 5, population std 2: every advantage below is exact arithmetic on small numbers.
REWARDS = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]

finite_rewards = st.lists(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False),
    min_size=2,
    max_size=32,
)


def test_grpo_divides_centred_rewards_by_population_std_plus_eps() -> None:
    expected = [(r - 5.0) / (2.0 + 1e-6) for r in REWARDS]

    assert grpo(REWARDS) == pytest.approx(expected, rel=1e-12), "grpo must be (r - mean)/(std+1e-6)"


def test_dr_grpo_only_subtracts_the_group_mean() -> None:
    assert dr_grpo(REWARDS) == [-3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 2.0, 4.0], (
        "dr_grpo must be r - mean without std normalisation"
    )


def test_rloo_subtracts_the_mean_of_the_other_rewards() -> None:
    advantages = rloo([1.0, 0.0, 0.0, 0.0])

    assert advantages == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], rel=1e-12), (
        "rloo of [1,0,0,0]: the winner's baseline is 0, each loser's is 1/3"
    )


def test_reinforce_returns_the_rewards_unchanged() -> None:
    assert reinforce(REWARDS) == REWARDS, "reinforce has no baseline"


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -3.7, 1e9])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_exactly_zero_advantages(name: str, value: float) -> None:
    advantages = compute_advantages(name, [value] * 5)

    assert advantages == [0.0] * 5, f"{name} of five rewards equal to {value} must be exact zeros"


def test_rloo_of_a_lone_rollout_is_zero() -> None:
    assert rloo([0.7]) == [0.0], "one rollout has no others to form a baseline"


@given(finite_rewards)
def test_rloo_equals_scaled_dr_grpo(rewards: list[float]) -> None:
    n = len(rewards)
    mean = math.fsum(rewards) / n
    expected = [n / (n - 1) * (r - mean) for r in rewards]

    assert rloo(rewards) == pytest.approx(expected, rel=1e-9, abs=1e-9), (
        "rloo must equal n/(n-1) * (r - mean)"
    )


@given(finite_rewards)
def test_centred_estimators_sum_to_zero(rewards: list[float]) -> None:
    for name in ("grpo", "dr_grpo", "rloo"):
        total = math.fsum(compute_advantages(name, rewards))

        assert total == pytest.approx(0.0, abs=1e-6), f"{name} advantages must sum to 0"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_keeps_length_and_order(name: str) -> None:
    advantages = compute_advantages(name, [0.0, 1.0, 0.5])

    assert len(advantages) == 3, f"{name} must return one advantage per reward"
    assert advantages[1] > advantages[2] > advantages[0], f"{name} must keep reward order"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_empty_group_gives_no_advantages(name: str) -> None:
    assert compute_advantages(name, []) == [], f"{name} of no rewards must be []"


def test_unknown_estimator_error_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="'gae'") as info:
        compute_advantages("gae", [1.0, 0.0])

    for name in ESTIMATORS:
        assert name in str(info.value), f"error must list valid estimator {name!r}"


def test_non_finite_reward_is_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        compute_advantages("grpo", [1.0, math.nan])


def test_estimators_are_exactly_the_names_config_accepts() -> None:
    config_names = set(typing.get_args(TrainerSection.model_fields["advantage"].annotation))

    assert set(ESTIMATORS) == config_names, "trainer.advantage and ESTIMATORS must agree"


@given(finite_rewards, st.integers(min_value=2, max_value=8))
def test_max_variance_subset_has_the_largest_spread_of_all_subsets(
    rewards: list[float], k: int
) -> None:
    rewards = rewards[:10]  # every subset is enumerated below
    k = min(k, len(rewards))

    def spread(indices: typing.Iterable[int]) -> float:
        values = [rewards[i] for i in indices]
        mean = math.fsum(values) / len(values)
        return math.fsum((v - mean) ** 2 for v in values)

    chosen = max_variance_subset(rewards, k)
    assert len(chosen) == k and chosen == sorted(set(chosen))
    best = max(spread(c) for c in itertools.combinations(range(len(rewards)), k))
    assert spread(chosen) == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_keep_per_group_is_at_least_two_and_at_most_the_group() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        TrainerSection(keep_per_group=1)
    with pytest.raises(ConfigError, match=r"keep_per_group \(9\) must be <= trainer.group_size"):
        load_config({"workflow": "m:W", "trainer": {"group_size": 8, "keep_per_group": 9}})


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
def test_a_group_baseline_over_one_rollout_is_refused_and_reinforce_is_not(advantage: str) -> None:
    # One rollout is its own group mean: every advantage would be 0, and nothing would train.
    one = {"workflow": "m:W", "trainer": {"group_size": 1, "advantage": advantage}}
    with pytest.raises(ConfigError, match=r"a group trains on 1: every advantage would be 0"):
        check_rl_groups(load_config(one))
    check_rl_groups(load_config({**one, "trainer": {"group_size": 1, "advantage": "reinforce"}}))
    sft = {**one, "trainer": {"group_size": 1, "advantage": advantage, "loss": "cross_entropy"}}
    check_rl_groups(load_config(sft))

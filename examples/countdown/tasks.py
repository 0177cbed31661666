"""Countdown problems: reach a target from a few numbers with `+ - * /`, each number used once.

Prompt format (ASCII, one line): the numbers separated by single spaces, then ` -> `, then the
target, e.g. `3 7 12 -> 33`. The answer is one expression over the numbers, each used exactly
once, whose exact value is the target, e.g. `3*7+12` (see `reward.py` for what is accepted).

Every target is reachable: a problem is drawn by building a random expression over random numbers
(`expressions.random_tree`) and keeping its value when it is a positive integer <= `max_target`.
A problem's split is a pure function of the problem itself (its sorted numbers and target), so the
train and eval splits are disjoint for every seed and every difficulty setting, and each split is
deterministic in `(seed, split)`. `make_tasks` is a data generator:
`{generator: "examples.countdown.tasks:make_tasks", n: 1000, split: eval}`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from examples.countdown.expressions import random_tree
from unified.types import Task

__all__ = [
    "EVAL_ONE_IN",
    "SPLITS",
    "Split",
    "draw_problem",
    "make_tasks",
    "problem_of",
    "prompt",
    "split_of",
]

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
EVAL_ONE_IN = 10
"""One problem in this many (by hash) belongs to the eval split."""

MIN_NUMBERS, MAX_NUMBERS = 2, 6
# The pool of distinct problems may be smaller than asked for; this many draws in a row with no
# new problem of the split means it is (nearly) exhausted.
_MAX_FRUITLESS_DRAWS = 20_000


def prompt(data: Mapping[str, Any]) -> str:
    """The prompt of a problem: `"3 7 12 -> 33"` for numbers [3, 7, 12] and target 33."""
    numbers, target = problem_of(data)
    return f"{' '.join(str(x) for x in numbers)} -> {target}"


def problem_of(data: Mapping[str, Any]) -> tuple[list[int], int]:
    """The `(numbers, target)` of a task's data; a ValueError names what is malformed."""
    numbers, target = data.get("numbers"), data.get("target")
    if (
        not isinstance(numbers, list)
        or not numbers
        or not all(_is_int(x) and x >= 0 for x in numbers)
        or not isinstance(target, int)
        or isinstance(target, bool)
    ):
        raise ValueError(
            "countdown task data needs 'numbers' (a non-empty list of ints >= 0) and "
            f"'target' (an int), got {dict(data)!r}"
        )
    return list(numbers), target


def split_of(numbers: Sequence[int], target: int) -> Split:
    """The split a problem belongs to, from a hash of its sorted numbers and its target."""
    canonical = f"{','.join(str(x) for x in sorted(numbers))}->{target}"
    digest = hashlib.sha256(canonical.encode("ascii")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_ONE_IN == 0 else "train"


def draw_problem(
    rng: random.Random, *, numbers: int = 3, max_number: int = 20, max_target: int = 100
) -> tuple[list[int], int]:
    """One reachable problem: `numbers` draws from 1..max_number and a target in 1..max_target.

    Redraws until a random expression over the numbers has a positive integer value no larger
    than `max_target`; that value is the target, so a solution always exists.
    """
    _check_difficulty(numbers, max_number, max_target)
    while True:
        values = [rng.randint(1, max_number) for _ in range(numbers)]
        _, value = random_tree(values, rng)
        if value.denominator == 1 and 0 < value <= max_target:
            return values, int(value)


def make_tasks(
    n: int,
    *,
    seed: int = 0,
    split: str = "train",
    numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
) -> list[Task]:
    """`n` distinct problems of one split, ids `"<split>-<i>"`, data `{"numbers", "target"}`.

    `numbers` (how many, 2..6) and `max_number` set the difficulty. The same arguments always
    give the same tasks; no problem (sorted numbers, target) appears in both splits. Raises
    ValueError when the split holds fewer than `n` distinct problems at this difficulty.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_difficulty(numbers, max_number, max_target)
    rng = random.Random(f"countdown/{split}/{seed}")
    seen: set[tuple[tuple[int, ...], int]] = set()
    tasks: list[Task] = []
    fruitless = 0
    while len(tasks) < n:
        values, target = draw_problem(
            rng, numbers=numbers, max_number=max_number, max_target=max_target
        )
        key = (tuple(sorted(values)), target)
        if key in seen or split_of(values, target) != split:
            fruitless += 1
            if fruitless == _MAX_FRUITLESS_DRAWS:
                raise ValueError(
                    f"found only {len(tasks)} distinct {split} problems with numbers={numbers}, "
                    f"max_number={max_number}, max_target={max_target} after "
                    f"{_MAX_FRUITLESS_DRAWS} draws without a new one; ask for fewer than n={n} "
                    "or raise numbers or max_number"
                )
            continue
        fruitless = 0
        seen.add(key)
        tasks.append(Task(id=f"{split}-{len(tasks)}", data={"numbers": values, "target": target}))
    return tasks


def _check_difficulty(numbers: int, max_number: int, max_target: int) -> None:
    if not MIN_NUMBERS <= numbers <= MAX_NUMBERS:
        raise ValueError(f"numbers must be in {MIN_NUMBERS}..{MAX_NUMBERS}, got {numbers}")
    if max_number < 1:
        raise ValueError(f"max_number must be >= 1, got {max_number}")
    if max_target < 1:
        raise ValueError(f"max_target must be >= 1, got {max_target}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

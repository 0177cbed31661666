"""What a policy scores on countdown without looking at the target: the bars RL must clear.

- `random_valid_expression`: the hit rate of `random_expression` (what the warm-started model
  writes before RL), averaged over `samples` draws per task.
- `best_fixed_pattern`: the best hit rate of one fixed expression pattern applied to every task,
  found by trying every tree shape x operator choice x order of the numbers, where the order is
  any permutation of the prompt's order or of the ascending order. A pattern is named like
  `ascending:(a+b)*c`, the letters standing for the numbers in that base order.

And one reference that does look at the target, though only at its size:
`best_pattern_by_target_band`, the hit rate when each band of ten targets (0-9, 10-19, ...) gets
its own best fixed pattern. It shows how far a policy gets by reading the target's magnitude.

The search is exhaustive: 2 * k! * Catalan(k-1) * 4^(k-1) patterns per task for k numbers
(384 for 3, 15,360 for 4, 860,160 for 5), so use a few tasks only for 5 or more numbers.

    python -m examples.countdown.baselines --n 1000 --split eval
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import string
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from examples.countdown.expressions import OPERATORS, BinOp, Expr, random_expression, render
from examples.countdown.reward import countdown_reward
from examples.countdown.tasks import make_tasks, problem_of
from unified.types import Task

__all__ = [
    "baselines",
    "best_fixed_pattern",
    "best_fixed_patterns",
    "best_pattern_by_target_band",
    "random_valid_expression_rate",
]

_BASES = ("prompt", "ascending")
_T = TypeVar("_T")
# An exact rational as (numerator, denominator), unnormalised; None after a division by zero.
_Rational = tuple[int, int] | None


def baselines(
    tasks: Sequence[Task], *, samples: int = 20, seed: int = 0, attempts: int = 1
) -> dict[str, float]:
    """`{"random_valid_expression": rate, "best_fixed_pattern": rate}`, both in [0, 1], for a
    policy with `attempts` tries per task that solves it if any try hits (a tool agent's checks):
    `attempts` random expressions, and the `attempts` fixed patterns that together hit most
    (chosen greedily: a lower bound on the best such set)."""
    return {
        "random_valid_expression": random_valid_expression_rate(
            tasks, samples=samples, seed=seed, attempts=attempts
        ),
        "best_fixed_pattern": best_fixed_patterns(tasks, attempts)[1],
    }


def random_valid_expression_rate(
    tasks: Sequence[Task], *, samples: int = 20, seed: int = 0, attempts: int = 1
) -> float:
    """Mean hit rate over `samples` draws per task of `attempts` random valid expressions (a draw
    hits if any of them does), scored by the real reward."""
    if not tasks or samples < 1 or attempts < 1:
        raise ValueError(
            f"need a task, samples >= 1 and attempts >= 1, got {len(tasks)}, {samples}, {attempts}"
        )
    rng = random.Random(seed)
    hits = 0
    for task in tasks:
        numbers, _ = problem_of(task.data)
        for _ in range(samples):
            tries = (random_expression(numbers, rng) for _ in range(attempts))
            hits += any(countdown_reward(expression, task.data)[1] for expression in tries)
    return hits / (len(tasks) * samples)


def best_fixed_pattern(tasks: Sequence[Task]) -> tuple[str, float]:
    """The fixed pattern with the highest hit rate over `tasks`, and that rate.

    All tasks must have the same count of numbers. Ties go to the first pattern enumerated.
    """
    names, hits = _pattern_hits(tasks)
    best = _best_pattern(hits, range(len(tasks)), len(names))
    return names[best], sum(best in row for row in hits) / len(tasks)


def best_fixed_patterns(tasks: Sequence[Task], attempts: int) -> tuple[list[str], float]:
    """`attempts` fixed patterns chosen greedily (each the one that hits most of the tasks the
    ones before miss), and the share of tasks at least one of them hits."""
    names, hits = _pattern_hits(tasks)
    chosen: list[int] = []
    missed = set(range(len(tasks)))
    for _ in range(attempts):
        best = _best_pattern(hits, missed, len(names))
        chosen.append(best)
        missed -= {i for i in missed if best in hits[i]}
    return [names[i] for i in chosen], (len(tasks) - len(missed)) / len(tasks)


def best_pattern_by_target_band(tasks: Sequence[Task], *, width: int = 10) -> float:
    """The hit rate when each band of targets (`target // width`) uses its own best pattern.

    A reference, not a bar to clear: what reading the target's rough size is worth to a policy
    (each band's pattern is chosen on these very tasks, so it is an optimistic figure).
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    names, hits = _pattern_hits(tasks)
    bands: dict[int, list[int]] = {}
    for i, task in enumerate(tasks):
        bands.setdefault(problem_of(task.data)[1] // width, []).append(i)
    total = 0
    for members in bands.values():
        best = _best_pattern(hits, members, len(names))
        total += sum(best in hits[i] for i in members)
    return total / len(tasks)


def _pattern_hits(tasks: Sequence[Task]) -> tuple[list[str], list[set[int]]]:
    """Every fixed pattern's name, and per task the indices of the patterns that hit it."""
    if not tasks:
        raise ValueError("a fixed-pattern baseline needs at least one task, got none")
    problems = [problem_of(task.data) for task in tasks]
    counts = {len(numbers) for numbers, _ in problems}
    if len(counts) != 1:
        raise ValueError(
            f"tasks mix counts of numbers {sorted(counts)}; compute baselines per count"
        )
    k = counts.pop()
    letters = list(string.ascii_lowercase[:k])
    names: list[str] = []
    for base in _BASES:
        for order in itertools.permutations(range(k)):
            labels: list[Expr] = [letters[i] for i in order]
            names.extend(f"{base}:{render(expr)}" for expr in _all_trees(labels, _join_expr))
    hits: list[set[int]] = []
    for numbers, target in problems:
        row: set[int] = set()
        index = 0
        for base_numbers in (numbers, sorted(numbers)):
            for order in itertools.permutations(range(k)):
                leaves: list[_Rational] = [(base_numbers[i], 1) for i in order]
                for value in _all_trees(leaves, _join_rational):
                    if value is not None and value[0] == target * value[1]:
                        row.add(index)
                    index += 1
        hits.append(row)
    return names, hits


def _best_pattern(hits: Sequence[set[int]], members: Iterable[int], n_patterns: int) -> int:
    """The pattern hitting the most of `members`' tasks; ties go to the first enumerated."""
    counts = [0] * n_patterns
    for i in members:
        for pattern in hits[i]:
            counts[pattern] += 1
    return max(range(n_patterns), key=lambda j: (counts[j], -j))


def _all_trees(leaves: Sequence[_T], join: Callable[[str, _T, _T], _T]) -> list[_T]:
    """Every tree over `leaves` in this order, with every operator choice, in a fixed order.

    The order depends only on `len(leaves)`, so the names and the values of patterns line up.
    """
    return _trees_between(leaves, 0, len(leaves), join, {})


def _trees_between(
    leaves: Sequence[_T],
    start: int,
    stop: int,
    join: Callable[[str, _T, _T], _T],
    memo: dict[tuple[int, int], list[_T]],
) -> list[_T]:
    if (start, stop) in memo:
        return memo[start, stop]
    if stop - start == 1:
        trees = [leaves[start]]
    else:
        trees = []
        for cut in range(start + 1, stop):
            lefts = _trees_between(leaves, start, cut, join, memo)
            rights = _trees_between(leaves, cut, stop, join, memo)
            trees.extend(
                join(op, left, right) for left in lefts for right in rights for op in OPERATORS
            )
    memo[start, stop] = trees
    return trees


def _join_expr(op: str, left: Expr, right: Expr) -> Expr:
    return BinOp(op, left, right)


def _join_rational(op: str, left: _Rational, right: _Rational) -> _Rational:
    # Unnormalised integer pairs: several times faster than Fraction, and just as exact.
    if left is None or right is None:
        return None
    (a, b), (c, d) = left, right
    if op == "+":
        return a * d + c * b, b * d
    if op == "-":
        return a * d - c * b, b * d
    if op == "*":
        return a * c, b * d
    return (a * d, b * c) if c != 0 else None


def main(argv: Sequence[str] | None = None) -> None:
    """Print (and with --json, write) the baselines of `make_tasks(...)`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=1000, help="tasks to score")
    parser.add_argument("--split", default="eval", choices=["train", "eval"])
    parser.add_argument("--seed", type=int, default=0, help="task seed (also the sampling seed)")
    parser.add_argument("--numbers", type=int, default=3, help="numbers per problem (2..6)")
    parser.add_argument("--max-number", type=int, default=20)
    parser.add_argument("--max-target", type=int, default=100)
    parser.add_argument("--samples", type=int, default=20, help="random expressions per task")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    tasks = make_tasks(
        args.n,
        seed=args.seed,
        split=args.split,
        numbers=args.numbers,
        max_number=args.max_number,
        max_target=args.max_target,
    )
    name, rate = best_fixed_pattern(tasks)
    figures: dict[str, float | str] = {
        "random_valid_expression": random_valid_expression_rate(
            tasks, samples=args.samples, seed=args.seed
        ),
        "best_fixed_pattern": rate,
        "best_fixed_pattern_name": name,
        "best_pattern_by_target_band": best_pattern_by_target_band(tasks),
    }
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

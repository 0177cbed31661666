"""What a countdown run answers, per evaluation: accuracy by target band and the greedy operator
patterns, read from the run's rollout records (every eval episode is recorded).

    .venv/bin/python -m examples.countdown.patterns runs/<run>

A run that has learned to read the target answers small targets with a subtraction (`+-`) and
keeps summing the middling ones (`++`); one that has not sums everything
(docs/notes/2026-12-countdown-floor.md).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from examples.countdown.tasks import problem_of
from unified.records import EpisodeRecord, EvalRecord, read_records

__all__ = ["BANDS", "EvalPatterns", "band_of", "eval_patterns", "main", "operators"]

BANDS: tuple[tuple[str, int], ...] = (("small", 20), ("middling", 60), ("large", 10**9))
"""Target bands by upper bound (exclusive): where the best fixed pattern changes."""


@dataclass
class EvalPatterns:
    """One evaluation: its accuracy, per band (hits, episodes), and the operator patterns."""

    step: int
    accuracy: float
    bands: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    patterns: Counter[str] = field(default_factory=Counter)


def band_of(target: int) -> str:
    """The band of a target: small (< 20), middling (< 60) or large."""
    return next(name for name, bound in BANDS if target < bound)


def operators(text: str) -> str:
    """An answer's operators in order (`"3+7-2"` -> `"+-"`); `?` when it has none."""
    return "".join(c for c in text if c in "+-*/") or "?"


def eval_patterns(run_dir: Path) -> list[EvalPatterns]:
    """Each evaluation of the run in `run_dir`, in step order, from its rollout records.

    Raises `RecordError` for a damaged record and ValueError for an episode that is not a
    countdown task."""
    records, _ = read_records(run_dir)
    evals = {r.step: EvalPatterns(r.step, r.accuracy) for r in records if isinstance(r, EvalRecord)}
    for r in records:
        if isinstance(r, EpisodeRecord) and r.outcome == "eval" and r.step in evals:
            seen = evals[r.step]
            text = "".join(p for turn in r.turns for p in turn.pieces if not p.startswith("<|"))
            _, target = problem_of(r.task)
            band = seen.bands[band_of(target)]
            band[0] += bool(r.correct)
            band[1] += 1
            seen.patterns[operators(text)] += 1
    return [evals[step] for step in sorted(evals)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<name>)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "records").is_dir():
        print(f"error: {args.run_dir} has no records/ (logging.records was off?)", file=sys.stderr)
        return 2
    try:
        evaluations = eval_patterns(args.run_dir)
    except (OSError, ValueError) as e:  # RecordError is a ValueError
        print(f"error: {args.run_dir}: {e}", file=sys.stderr)
        return 2
    if not evaluations:
        print(
            f"error: {args.run_dir} recorded no evaluations (logging.record_eval was off?)",
            file=sys.stderr,
        )
        return 2
    for e in evaluations:
        bands = " ".join(
            f"{name} {100 * hits / n:.0f}%" for name, _ in BANDS for hits, n in [e.bands[name]] if n
        )
        top = ", ".join(f"{p} {n}" for p, n in e.patterns.most_common(3))
        print(f"step {e.step:5d}  {100 * e.accuracy:5.1f}%  {bands}  | {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Supervised warm-start data: countdown prompts answered by random *valid* expressions.

A tiny built-in model cannot learn the answer format from reward alone, so `unified sft` first
teaches it: each example pairs a fresh train-split prompt with a random expression using every
number exactly once. The expressions are not solutions (they hit the target only by chance), so
the warm start teaches the format and leaves finding the target to RL.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from examples.countdown.expressions import random_expression
from examples.countdown.tasks import draw_problem, prompt, split_of

__all__ = ["random_expression", "warmstart_examples", "write_jsonl"]


def warmstart_examples(
    n: int,
    *,
    seed: int = 0,
    numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    in_order: float = 0.0,
) -> list[dict[str, Any]]:
    """`n` chat examples `{"messages": [user prompt, assistant expression]}`, deterministic in seed.

    Problems are drawn like `make_tasks`' (same difficulty keywords) and kept only if they belong
    to the train split, so no eval prompt is ever seen in the warm start; repeats are allowed.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"countdown-warmstart/{seed}")
    examples: list[dict[str, Any]] = []
    while len(examples) < n:
        values, target = draw_problem(
            rng, numbers=numbers, max_number=max_number, max_target=max_target
        )
        if split_of(values, target) != "train":
            continue
        data = {"numbers": values, "target": target}
        # Keeping the prompt's order part of the time makes copying the numbers easier to learn.
        shuffle = rng.random() >= in_order
        examples.append(
            {
                "messages": [
                    {"role": "user", "content": prompt(data)},
                    {
                        "role": "assistant",
                        "content": random_expression(values, rng, shuffle=shuffle),
                    },
                ]
            }
        )
    return examples


def write_jsonl(path: str | Path, examples: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line to `path` atomically: readers see all of it or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for example in examples:
                f.write(json.dumps(example) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

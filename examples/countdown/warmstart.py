"""Supervised warm-start data: countdown prompts answered by random *valid* expressions.

The tool agent's warm start (`tool_warmstart_examples`) mixes in episodes that check random
expressions with the calculator, covering the tool-call format.

A tiny built-in model cannot learn the answer format from reward alone, so `unified sft` first
teaches it: each example pairs a fresh train-split prompt with a random expression using every
number exactly once. The expressions are not solutions (they hit the target only by chance), so
the warm start teaches the format and leaves finding the target to RL.

Random expressions never need the target, so a model taught only them ignores it, and RL must
build the reading of it from nothing. A `target_share` of the examples therefore ask for the
target back instead (`3 7 12 -> 33 ?` answered `33`): not an answer to any problem, but the
model comes to RL already reading the target.
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
from examples.countdown.tool_agent import calc_result, tool_call

__all__ = [
    "TARGET_SUFFIX",
    "random_expression",
    "tool_warmstart_examples",
    "warmstart_examples",
    "write_jsonl",
]

TARGET_SUFFIX = " ?"
"""Ends the prompt of a warm-start example that asks for the target (`3 7 12 -> 33 ?`)."""


def warmstart_examples(
    n: int,
    *,
    seed: int = 0,
    numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    in_order: float = 0.0,
    target_share: float = 0.0,
) -> list[dict[str, Any]]:
    """`n` chat examples `{"messages": [user prompt, assistant expression]}`, deterministic in seed.

    Problems are drawn like `make_tasks`' (same difficulty keywords) and kept only if they belong
    to the train split, so no eval prompt is ever seen in the warm start; repeats are allowed.
    A `target_share` of them ask for the target instead (`TARGET_SUFFIX`, answered with it).
    """
    return tool_warmstart_examples(
        n,
        seed=seed,
        numbers=numbers,
        max_number=max_number,
        max_target=max_target,
        in_order=in_order,
        tool_share=0.0,
        target_share=target_share,
    )


def tool_warmstart_examples(
    n: int,
    *,
    seed: int = 0,
    numbers: int = 3,
    max_number: int = 20,
    max_target: int = 100,
    in_order: float = 0.0,
    tool_share: float = 0.5,
    max_checks: int = 2,
    target_share: float = 0.0,
) -> list[dict[str, Any]]:
    """`n` chat examples for `CountdownToolAgent`: direct answers and checked ones, mixed.

    A `tool_share` of the problems are checked: up to `max_checks` calls of `calc` on distinct
    random valid expressions, one example per call, each seeing the calls and values before it;
    a hit ends the episode (the agent scores it), and after `max_checks` misses an example
    answers another expression. The rest are answered directly, as in `warmstart_examples`
    (which is this with `tool_share=0`). Expressions are never chosen by the target, so the
    warm start covers the format and leaves the policy to RL. A `target_share` of the problems
    ask for the target instead, as in `warmstart_examples`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share}")
    if max_checks < 1:
        raise ValueError(f"max_checks must be >= 1, got {max_checks}")
    if not 0.0 <= target_share < 1.0:
        raise ValueError(f"target_share must be in [0, 1), got {target_share}")
    rng = random.Random(f"countdown-warmstart/{seed}")
    examples: list[dict[str, Any]] = []
    while len(examples) < n:
        values, target = draw_problem(
            rng, numbers=numbers, max_number=max_number, max_target=max_target
        )
        if split_of(values, target) != "train":
            continue
        text = prompt({"numbers": values, "target": target})
        # Drawn only when asked for, so target_share=0 keeps the old examples for the same seed.
        if target_share and rng.random() < target_share:
            examples.append(_chat({"role": "user", "content": text + TARGET_SUFFIX}, str(target)))
            continue
        context: list[dict[str, Any]] = [{"role": "user", "content": text}]
        # Drawn only when checking, so tool_share=0 keeps the old examples for the same seed.
        if tool_share == 0.0 or rng.random() >= tool_share:
            examples.append(_chat(*context, _expression(values, rng, in_order)))
            continue
        tried: set[str] = set()
        for _ in range(max_checks):
            candidate = _untried(values, rng, in_order, tried)
            call = tool_call(candidate)
            examples.append(_chat(*context, call))
            value = calc_result(candidate)
            if value == str(target):
                break
            context += [
                {"role": "assistant", "content": call},
                {"role": "tool", "name": "calc", "content": value},
            ]
        else:
            examples.append(_chat(*context, _untried(values, rng, in_order, tried)))
    return examples[:n]


def _untried(values: list[int], rng: random.Random, in_order: float, tried: set[str]) -> str:
    """A random expression not in `tried` (added to it), or a repeat if few others exist."""
    for _ in range(20):
        expression = _expression(values, rng, in_order)
        if expression not in tried:
            break
    tried.add(expression)
    return expression


def _expression(values: list[int], rng: random.Random, in_order: float) -> str:
    # Keeping the prompt's order part of the time makes copying the numbers easier to learn.
    return random_expression(values, rng, shuffle=rng.random() >= in_order)


def _chat(*messages: dict[str, Any] | str) -> dict[str, Any]:
    """An SFT example: the messages, the last one (a str) the assistant reply to learn."""
    *context, reply = messages
    return {"messages": [*context, {"role": "assistant", "content": reply}]}


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

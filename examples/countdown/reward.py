"""The countdown reward: is the model's answer an expression over the numbers that hits the target?

An answer is the model's reply, stripped of surrounding whitespace, up to its first line break.
It is accepted only if it is at most `MAX_ANSWER_CHARS` ASCII characters of digits, `+ - * /`,
parentheses and spaces, parses (`ast.parse`, never `eval`) into nothing but binary `+ - * /` over
non-negative integer literals, uses the task's numbers exactly once each (as a multiset), and has
a finite exact value (`fractions.Fraction`). Scores: 1.0 when that value is the target,
`format_reward` (plus, for an integer, a closeness bonus) when it is not, 0.0 for anything else.
Scoring never raises on any reply text.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from examples.countdown.expressions import apply
from examples.countdown.tasks import problem_of

__all__ = [
    "CLOSENESS_SCALE_FLOOR",
    "MAX_ANSWER_CHARS",
    "answer_of",
    "countdown_reward",
    "expression_value",
    "parse_expression",
]

MAX_ANSWER_CHARS = 64
"""Longer answers are rejected unparsed: no countdown solution needs more, and it bounds work."""

CLOSENESS_SCALE_FLOOR = 10
"""A miss is measured relative to the target, but never to less than this (small targets)."""

_ANSWER_CHARS = re.compile(r"[0-9+\-*/() ]+")
_OPERATORS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
}


class _Rejected(Exception):
    """The answer contains something other than binary `+ - * /` over integer literals."""


def answer_of(text: str) -> str:
    """The answer part of a reply: stripped of surrounding whitespace, up to the first newline."""
    return text.strip().split("\n", 1)[0].strip()


def expression_value(text: str) -> tuple[Fraction, list[int]]:
    """The exact value of an arithmetic answer and its integer literals, in order.

    Raises ValueError naming what is wrong when `answer_of(text)` is not pure `+ - * /` over
    non-negative integer literals (or is longer than `MAX_ANSWER_CHARS`), and ZeroDivisionError
    when it divides by zero. The numbers are not checked against a task: that is
    `parse_expression`'s job.
    """
    answer = answer_of(text)
    if len(answer) > MAX_ANSWER_CHARS or not _ANSWER_CHARS.fullmatch(answer):
        raise ValueError(
            f"not an arithmetic expression of at most {MAX_ANSWER_CHARS} characters of digits, "
            f"+ - * / ( ) and spaces: {answer[:MAX_ANSWER_CHARS]!r}"
        )
    try:
        tree = ast.parse(answer, mode="eval")
        leaves: list[int] = []
        _collect_leaves(tree.body, leaves)
    except (SyntaxError, RecursionError, MemoryError, _Rejected) as e:
        raise ValueError(f"not an arithmetic expression: {answer!r}") from e
    return _evaluate(tree.body), leaves


def parse_expression(text: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of `text` if it is a well-formed expression over exactly `numbers`.

    None when the text is malformed, is not pure `+ - * /` arithmetic on integer literals, uses
    the numbers other than once each, or divides by zero. Never raises.
    """
    try:
        value, leaves = expression_value(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value if Counter(leaves) == Counter(numbers) else None


def countdown_reward(
    text: str,
    data: Mapping[str, Any],
    *,
    format_reward: float = 0.1,
    closeness_reward: float = 0.0,
) -> tuple[float, bool]:
    """`(reward, correct)` for a reply to the task with `data` `{"numbers", "target"}`.

    `(1.0, True)` when the answer hits the target; a valid expression over the numbers that misses
    it earns `format_reward`, and an integer miss up to `closeness_reward` more the nearer it is
    to the target (`1 - |value - target| / max(target, 10)`, floored at 0): a dense signal that
    depends on the target. Fractions get no closeness: they can never hit an integer target, and
    crediting them teaches a policy to divide its way near small targets. Anything else is
    `(0.0, False)`. Malformed task data (not the reply) raises ValueError: a dataset bug, not a
    bad answer.
    """
    numbers, target = problem_of(data)
    value = parse_expression(text, numbers)
    if value is None:
        return 0.0, False
    if value == target:
        return 1.0, True
    if value.denominator != 1:
        return format_reward, False
    miss = abs(float(value) - target) / max(abs(target), CLOSENESS_SCALE_FLOOR)
    return format_reward + closeness_reward * max(0.0, 1.0 - miss), False


def _collect_leaves(node: ast.expr, leaves: list[int]) -> None:
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _OPERATORS:
            raise _Rejected(f"operator {type(node.op).__name__}")
        _collect_leaves(node.left, leaves)
        _collect_leaves(node.right, leaves)
    elif isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        leaves.append(node.value)
    else:
        raise _Rejected(f"node {type(node).__name__}")


def _evaluate(node: ast.expr) -> Fraction:
    # Only called on trees `_collect_leaves` accepted.
    if isinstance(node, ast.BinOp):
        return apply(_OPERATORS[type(node.op)], _evaluate(node.left), _evaluate(node.right))
    assert isinstance(node, ast.Constant) and type(node.value) is int
    return Fraction(node.value)

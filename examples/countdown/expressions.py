"""Random arithmetic expressions over a list of numbers, with their exact values.

An expression is a binary tree: leaves are the numbers (or, in a fixed pattern, position labels
such as "a"), inner nodes are `+ - * /`. `render` writes it compactly, with no spaces and only the
parentheses the value needs, so that Python's parser reads back the same exact value. Every
expression `random_tree` builds uses each given number exactly once and never divides by zero.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TypeAlias

__all__ = [
    "OPERATORS",
    "BinOp",
    "Expr",
    "apply",
    "evaluate",
    "random_expression",
    "random_tree",
    "render",
]

OPERATORS = ("+", "-", "*", "/")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_LEAF_PRECEDENCE = 3


@dataclass(frozen=True)
class BinOp:
    """An inner node: `left op right`."""

    op: str
    left: Expr
    right: Expr


Expr: TypeAlias = int | str | BinOp
"""A number, a position label (in a fixed pattern), or a binary operation."""


def apply(op: str, left: Fraction, right: Fraction) -> Fraction:
    """`left op right` in exact arithmetic; raises ZeroDivisionError for `x / 0`."""
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if op == "/":
        return left / right
    raise ValueError(f"unknown operator {op!r}; expected one of {OPERATORS}")


def evaluate(expr: Expr) -> Fraction:
    """The exact value of an expression over numbers; raises ZeroDivisionError for `x / 0`."""
    if isinstance(expr, BinOp):
        return apply(expr.op, evaluate(expr.left), evaluate(expr.right))
    if isinstance(expr, int):
        return Fraction(expr)
    raise ValueError(f"cannot evaluate the position label {expr!r}; substitute a number first")


def render(expr: Expr) -> str:
    """Compact text of `expr`: no spaces, parentheses only where precedence needs them.

    A right operand of `-` or `/` keeps its parentheses at equal precedence (`a-(b-c)`); other
    regroupings the text drops (`a+(b-c)` -> `a+b-c`, `a*(b/c)` -> `a*b/c`) keep the exact value
    and divide by the same subexpressions.
    """
    if not isinstance(expr, BinOp):
        return str(expr)
    precedence = _PRECEDENCE[expr.op]
    left = render(expr.left)
    if _precedence_of(expr.left) < precedence:
        left = f"({left})"
    right = render(expr.right)
    right_precedence = _precedence_of(expr.right)
    if right_precedence < precedence or (right_precedence == precedence and expr.op in "-/"):
        right = f"({right})"
    return f"{left}{expr.op}{right}"


def random_tree(
    numbers: Sequence[int], rng: random.Random, *, shuffle: bool = True
) -> tuple[Expr, Fraction]:
    """A random expression using every number exactly once, and its exact value.

    The numbers are shuffled (unless `shuffle` is false), split at random points into a binary
    tree, and joined by random operators; a `/` whose divisor is zero is redrawn from `+ - *`, so
    the value is always finite.
    """
    if not numbers:
        raise ValueError("random_tree needs at least one number, got none")
    order = list(numbers)
    if shuffle:
        rng.shuffle(order)
    return _build(order, rng)


def random_expression(numbers: Sequence[int], rng: random.Random, *, shuffle: bool = True) -> str:
    """The compact text of a random expression using every number exactly once (see `render`)."""
    expr, _ = random_tree(numbers, rng, shuffle=shuffle)
    return render(expr)


def _build(order: list[int], rng: random.Random) -> tuple[Expr, Fraction]:
    if len(order) == 1:
        return order[0], Fraction(order[0])
    cut = rng.randint(1, len(order) - 1)
    left, left_value = _build(order[:cut], rng)
    right, right_value = _build(order[cut:], rng)
    op = rng.choice(OPERATORS)
    if op == "/" and right_value == 0:
        op = rng.choice(OPERATORS[:3])
    return BinOp(op, left, right), apply(op, left_value, right_value)


def _precedence_of(expr: Expr) -> int:
    return _PRECEDENCE[expr.op] if isinstance(expr, BinOp) else _LEAF_PRECEDENCE

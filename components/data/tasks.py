"""The synthetic tool-integrated arithmetic task: the embedded stand-in for real math problem sets.

Problems are generated from a seed, so every run (and every test) sees the same data. Training and held-out
splits use different seed streams and the held-out questions are removed from the training split, so the
held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Kind = Literal["affine", "two_step"]
KINDS: tuple[Kind, ...] = ("affine", "two_step")
_SPLIT_SALT = {"train": 0, "eval": 1}
_HELD_OUT_GUARD = 10_000
"""The training split excludes this many leading held-out questions, more than any eval set we run."""


@dataclass(frozen=True)
class Problem:
    problem_id: str
    """Stable id: `<split>-<kind>-<index>`."""
    kind: Kind
    """Problem family."""
    question: str
    """The user's question, e.g. `Compute 37*12+5.`"""
    answer: int
    """Exact integer answer."""
    operands: tuple[int, ...]
    """The numbers in the question, in order."""


def make_problem(kind: Kind, operands: tuple[int, ...], problem_id: str) -> Problem:
    """Build a problem of `kind` from its operands (a, b, c) or (a, b, c, d)."""
    if kind == "affine":
        a, b, c = operands
        return Problem(problem_id, kind, f"Compute {a}*{b}+{c}.", a * b + c, operands)
    if kind == "two_step":
        a, b, c, d = operands
        return Problem(problem_id, kind, f"Compute ({a}*{b}+{c})*{d}.", (a * b + c) * d, operands)
    raise ValueError(f"kind: unknown problem family {kind!r}; known: {list(KINDS)}")


def generate_problems(
    kinds: tuple[Kind, ...], n: int, seed: int, operand_max: int, split: Literal["train", "eval"]
) -> list[Problem]:
    """`n` problems cycling through `kinds`; deterministic in (seed, split)."""
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(seed * 1_000_003 + _SPLIT_SALT[split])
    exclude = (
        set()
        if split == "eval"
        else {p.question for p in generate_problems(kinds, _HELD_OUT_GUARD, seed, operand_max, "eval")}
    )
    problems: list[Problem] = []
    index = 0
    while len(problems) < n:
        kind = kinds[index % len(kinds)]
        arity = 3 if kind == "affine" else 4
        operands = tuple(rng.randint(2, operand_max) for _ in range(arity))
        problem = make_problem(kind, operands, f"{split}-{kind}-{index}")
        index += 1
        if problem.question not in exclude:
            problems.append(problem)
    return problems

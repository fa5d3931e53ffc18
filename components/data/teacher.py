"""Programmatic teacher: writes the TIR trace a strong model would write for a synthetic problem.

The embedded stand-in for distilling GPT-OSS-120B: one tool call per arithmetic step, the tool's exact
stdout as the observation, and the answer copied from the last output into `\\boxed{}`. The code it writes
is our own (never model output), so its output is computed directly rather than in the sandbox; a test
checks that the sandbox prints the same.

Like a real large teacher, it does small products in its head: when `a * b < mental_max` it answers
directly, without a tool call. Every trace is correct, but the tiny student cannot multiply in its head, so
imitating that habit costs it accuracy on exactly those problems. This capacity gap between teacher and
student is what RL closes in the SAO paper (SFT on Python traces 80.4% -> SAO 97.3% on AIME2025), and it
is what leaves the embedded RL run room to improve. `mental_max = 0` turns the habit off.

`mental_frac` < 1 makes the habit a tendency: the teacher answers only that fraction of the small products in its
head (which ones is fixed by a hash of the question) and calls the tool on the rest, so the student also sees the
tool used, and its output copied, on the small problems it will have to learn to solve with the tool.
"""

from __future__ import annotations

import hashlib

from components.data.tasks import Problem
from components.data.traces import Trace, Turn


def teacher_trace(problem: Problem, mental_max: int = 0, mental_frac: float = 1.0) -> Trace:
    """The reference TIR trace of a problem; answered without the tool when `a * b < mental_max` and the question
    falls in the `mental_frac` share of such problems the teacher does in its head."""
    turns = [Turn("user", problem.question)]
    if problem.operands[0] * problem.operands[1] < mental_max and _share(problem.question) < mental_frac:
        turns.append(Turn("assistant", f"\\boxed{{{problem.answer}}}"))
        return Trace(problem.problem_id, tuple(turns), problem.answer)
    if problem.kind == "affine":
        a, b, c = problem.operands
        steps = [(f"print({a}*{b}+{c})", a * b + c)]
    elif problem.kind == "two_step":
        a, b, c, d = problem.operands
        first = a * b + c
        steps = [(f"print({a}*{b}+{c})", first), (f"print({first}*{d})", first * d)]
    else:
        raise ValueError(f"problem {problem.problem_id}: the teacher has no solution for kind {problem.kind!r}")
    for code, value in steps:
        turns.append(Turn("assistant", "", code))
        turns.append(Turn("tool", f"{value}\n"))
    turns.append(Turn("assistant", f"\\boxed{{{problem.answer}}}"))
    return Trace(problem.problem_id, tuple(turns), problem.answer)


def _share(question: str) -> float:
    """A fixed point in [0, 1) for a question (a hash), so the teacher's choice is the same in every process."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64

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
"""

from __future__ import annotations

from components.data.tasks import Problem
from components.data.traces import Trace, Turn


def teacher_trace(problem: Problem, mental_max: int = 0) -> Trace:
    """The reference TIR trace of a problem; answered without the tool when `a * b < mental_max`."""
    turns = [Turn("user", problem.question)]
    if problem.operands[0] * problem.operands[1] < mental_max:
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

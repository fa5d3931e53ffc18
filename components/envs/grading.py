"""Grading of `\\boxed{}` answers: exact integers for integer answers, math-verify and the answer rules otherwise.

`grade_answer(text, answer)` reads the last `\\boxed{...}` of a model turn. With an integer answer the box must
hold exactly that integer (` 449 ` and `-3` pass, `449.0` and `4,49` do not): the synthetic arithmetic task and
its reward numbers depend on this staying strict, and it never starts math-verify. With a string or float
answer (a benchmark's `\\frac{3}{4}`, `(1, 2)`, `\\sqrt{2}`) the box is compared with `math_equal`.
`reference_answer` turns a string that is a plain integer (`"449"`, as JSONL problem sets often store answers)
into an int, so a file's encoding does not change how strictly a task is graded. `task_reference` is what an
environment passes: a benchmark's answer (`Task.metadata["benchmark"]`, set by `components.eval.benchmarks`) as
text, so that every benchmark answer, an AIME integer too, is graded by value (`449.0`, `$449$`, `x = 449`
are 449: measured, the exact-integer rule only ever lost on benchmark references); any other task's through
`reference_answer`.

`math_equal(pred, ref)` decides whether the answer `pred` denotes the value of the reference `ref`. Measured side
by side on IMO-AnswerBench's 400 references, the tests' benchmark rows and the grader's tests (docs/grading.md,
`python -m bench.grading_compare`), math-verify recognises equal values the hand-written rules cannot
(`\\sqrt{8}` and `2\\sqrt{2}`, `1+\\sqrt{2}` and `\\sqrt{2}+1`, the mixed number `3\\frac{1}{2}`, `1.2\\times 10^{3}`,
conditions reordered), and the rules were right where math-verify was not: exact numbers (math-verify rounds a
decimal to 6 places, so `0.333333` was `\\frac{1}{3}`), sets against tuples and intervals (`\\{1, 2\\}` was the open
interval `(1, 2)`), thousands separators (`1\\,000`, `(1{,}000, 2)`) and spacing it does not read. Hence, in order:

1. The rules (`components.envs.answer_rules.rules_equal`) say equal: equal. Measured, they are never wrong when
   they say so.
2. Both answers are numbers or lists of numbers that the rules read whole (`answer_rules.is_numeric`): the
   rules' verdict stands. Exact rationals and the kinds of brackets are all there is to compare.
3. Otherwise math-verify decides (`components.envs.math_verifier`: a worker process, each comparison bounded by
   `math_verifier.TIMEOUT_S`, its decimals made exact rationals first). No verdict in time: not equal.

A grade costs microseconds when the rules settle it and about 1 ms (median; 45-150 ms at the 99th percentile)
when math-verify is asked; the first call starts the worker (about a second). The rules only rewrite strings; the
worker runs math-verify with its LaTeX parser only (not `ExprExtractionConfig`, whose sympy `parse_expr` would
`eval` the text), where sympy passes only the parser's number tokens through `eval`
(`tests/envs/test_math_verifier.py` records what reaches it), in a process of its own.
"""

from __future__ import annotations

import re
from typing import Any

from components.contracts.task import Task
from components.envs.answer_rules import MAX_ANSWER_CHARS, closing_brace, is_numeric, reference_text, rules_equal
from components.envs.math_verifier import VERIFIER

_INTEGER = re.compile(r"[+-]?\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces matched), or None (no box, or the last one unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start + len("\\boxed"))
    return text[start + len("\\boxed{") : end] if end >= 0 else None


def reference_answer(answer: Any) -> Any:
    """A task's answer ready for `grade_answer`: a string that is a plain integer (`"449"`, `" -3 "`) becomes
    an int, so it is graded exactly like the int it stands for; anything else is returned unchanged."""
    if isinstance(answer, str) and _INTEGER.fullmatch(answer.strip()):
        return int(answer.strip())
    return answer


def task_reference(task: Task) -> int | str | float:
    """The reference `grade_answer` gets for `task`: a benchmark's answer as text (graded by value, an integer
    too), any other task's through `reference_answer` (a plain integer graded exactly)."""
    if "benchmark" in task.metadata and not isinstance(task.answer, (bool, float)):
        return str(task.answer).strip()
    return reference_answer(task.answer)


def grade_answer(text: str, answer: int | str | float) -> bool:
    """True when the last boxed answer of `text` is `answer`: exactly, for an int (surrounding spaces allowed);
    by `math_equal`, for a string or a float."""
    boxed = extract_boxed(text)
    if boxed is None:
        return False
    if isinstance(answer, int) and not isinstance(answer, bool):
        boxed = boxed.strip()
        return bool(_INTEGER.fullmatch(boxed)) and int(boxed) == answer
    return math_equal(boxed, answer)


def math_equal(pred: str | None, ref: str | int | float) -> bool:
    """True when the answer `pred` denotes the value of the reference `ref` (the rule in the module docstring).
    `pred` is untrusted model output; None (no answer) and an answer over `MAX_ANSWER_CHARS` are never equal.
    Not symmetric in general: math-verify reads the reference as the gold answer.

    Raises:
        TypeError: `ref` is not a str, int or float (a bool is refused: it is no answer).
    """
    gold = reference_text(ref)
    if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS or not gold:
        return False
    if rules_equal(pred, gold):
        return True
    if is_numeric(pred) and is_numeric(gold):
        return False
    return VERIFIER.verify_equal(pred, gold) is True

"""`reasoning_gym_tir`: tir_math on a reasoning-gym arithmetic set, with a programmatic teacher for its questions.

    env.entrypoint = "components.envs.reasoning_gym_tir:factory"
    env.tasks = "reasoning-gym:basic_arithmetic?size=20000&..."

The episodes, tools and held-out set are tir_math's (components/envs/builtin.py) on `env.tasks`, scored by the
dataset's `score_answer`. What this adds is the teacher: tir_math's own writes traces for the synthetic
`Compute a*b+c.` problems only, and the tiny policy trained on those transfers to no reasoning-gym wording (0% on
every arithmetic set tried, pass@8 0: docs/environments.md, "Task sets from reasoning-gym"), so RL would have no
reward to learn from. This teacher writes the same kind of trace for each training entry of an arithmetic dataset
whose entries carry `metadata["expression"]` (basic_arithmetic, chain_sum, products): the expression printed by
the Python tool (`/` written `//`: the datasets divide exactly or floor), the output, the boxed answer.

Like tir_math's teacher it answers some problems in its head (`task.teacher_mental_max`, `task.teacher_mental_frac`:
here when |answer| < mental_max), which the student cannot imitate; RL closes that gap by learning to call the tool.
An entry whose expression does not evaluate, under Python's rules, to its answer (basic_arithmetic without
parentheses computes left to right) gets no trace; a set where none does is an error.
"""

from __future__ import annotations

import ast
import hashlib
import operator
from dataclasses import replace

from components.contracts.environment import EnvContext, EnvSetup
from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.data.reasoning_gym_tasks import is_gym_task
from components.envs.builtin import tir_math

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def integer_value(code: str) -> int:
    """The value of an integer expression of `+ - * //`, parentheses and signs, without running it (the teacher's
    output is computed here, like tir_math's; a test checks that the sandbox prints the same).

    Raises:
        ValueError: anything else (names, calls, other operators, non-integers), or division by zero.
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ValueError(f"{code!r}: division by zero")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"{code!r}: not an integer expression of + - * // ({ast.dump(node)[:60]})")

    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{code!r}: not an expression: {exc.msg}") from None
    return value(tree.body)


def _share(question: str) -> float:
    """A fixed point in [0, 1) per question, so the teacher's habit is the same in every process."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64


def gym_trace(task: Task, mental_max: int = 0, mental_frac: float = 1.0) -> Trace | None:
    """The teacher's TIR trace of a reasoning-gym arithmetic task, or None when the entry has no expression or its
    expression does not evaluate to the entry's integer answer under Python's rules."""
    if not is_gym_task(task):
        return None
    entry = task.metadata["reasoning_gym"]["entry"]
    expression = entry.get("metadata", {}).get("expression")
    answer = str(entry["answer"]).strip()
    if not isinstance(expression, str) or not answer.lstrip("-").isdigit():
        return None
    code = expression.replace("/", "//")
    try:
        value = integer_value(code)
    except ValueError:
        return None
    if value != int(answer):
        return None
    user = Turn("user", task.prompt)
    final = Turn("assistant", f"\\boxed{{{value}}}")
    if abs(value) < mental_max and _share(task.prompt) < mental_frac:
        return Trace(task.task_id, (user, final), value)
    return Trace(
        task.task_id, (user, Turn("assistant", "", f"print({code})"), Turn("tool", f"{value}\n"), final), value
    )


def gym_traces(tasks: list[Task], mental_max: int, mental_frac: float, where: str) -> list[Trace]:
    traces = [t for t in (gym_trace(task, mental_max, mental_frac) for task in tasks) if t is not None]
    if not traces:
        raise ValueError(
            f"{where}: the reasoning-gym teacher solved none of its {len(tasks)} tasks: it needs entries with an "
            "integer answer and metadata.expression of + - * / (basic_arithmetic with parentheses, chain_sum, "
            "products)"
        )
    return traces


def factory(options: dict, context: EnvContext) -> EnvSetup:
    """tir_math on the reasoning-gym set `env.tasks`, with the teacher above for `distill.teacher = "programmatic"`."""
    cfg = context.config
    if not cfg.env.tasks.startswith("reasoning-gym:"):
        raise ValueError(f"env.tasks: reasoning_gym_tir needs a reasoning-gym:<dataset>?... set, got {cfg.env.tasks!r}")
    setup = tir_math(options, context)  # with env.tasks set, its prompts are that set's task list
    tasks, t = list(setup.prompts), cfg.task
    return replace(setup, teacher=lambda: gym_traces(tasks, t.teacher_mental_max, t.teacher_mental_frac, "env.tasks"))

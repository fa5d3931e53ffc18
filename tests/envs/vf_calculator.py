"""A verifiers environment for the tests (issue 43), written against verifiers' own contract: `load_environment`
returns a `vf.ToolEnv` on generated "Compute a*b+c." problems, with one tool and a rubric.

The tool is a calculator named `python` taking a `code` string, because the tiny test policy's chat format (the
markers) calls only that: it prints the value of each `print(<integer arithmetic>)` line, and refuses anything
else with an error the model sees. The rubric's reward is `1.0 * correct + 0.25 * used_calculator`: `correct`
is the exact answer in `\\boxed{}` after at least one calculator call, so every solved episode called the tool.
"""

from __future__ import annotations

import ast
import operator
import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Use the python tool to compute, then answer with \\boxed{}."
WEIGHTS = (1.0, 0.25)
"""The rubric's weights: correct answer, calculator used."""
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def problems(n: int, seed: int) -> list[dict]:
    """`n` rows: "Compute a*b+c." with a, b, c in 1..99 and the answer as a string."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(1, 99)
        rows.append({"question": f"Compute {a}*{b}+{c}.", "answer": str(a * b + c), "info": {"operands": [a, b, c]}})
    return rows


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"the calculator evaluates integer + - * // only, not {ast.unparse(node)!r}")


def python(code: str) -> str:
    """Print the value of each print(<integer arithmetic>) line.

    Args:
        code: lines such as print(12*34+5).
    """
    out = []
    for statement in ast.parse(code).body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print" and len(call.args) == 1):
            raise ValueError("the calculator runs print(<arithmetic>) lines only")
        out.append(f"{_value(call.args[0])}\n")
    return "".join(out)


def calculator_calls(completion: list) -> int:
    return sum(len(m.tool_calls or []) for m in completion if m.role == "assistant")


def boxed(completion: list) -> str | None:
    answers = [m for m in completion if m.role == "assistant" and not m.tool_calls]
    found = re.findall(r"\\boxed\{(-?\d+)\}", answers[-1].content or "") if answers else []
    return found[-1] if found else None


async def correct(completion, answer, **kwargs) -> float:
    return float(calculator_calls(completion) > 0 and boxed(completion) == answer)


async def used_calculator(completion, **kwargs) -> float:
    return float(calculator_calls(completion) > 0)


def load_environment(num_train: int = 64, num_eval: int = 8, seed: int = 0, max_turns: int = 4) -> vf.ToolEnv:
    rubric = vf.Rubric(funcs=[correct, used_calculator], weights=list(WEIGHTS))
    return vf.ToolEnv(
        dataset=Dataset.from_list(problems(num_train, seed)),
        eval_dataset=Dataset.from_list(problems(num_eval, seed + 1)) if num_eval else None,
        system_prompt=SYSTEM_PROMPT,
        tools=[python],
        rubric=rubric,
        max_turns=max_turns,
        pass_threshold=1.0,
    )

"""The reasoning-gym TIR environment's teacher: the expression it prints, the value it computes without running
it (and the sandbox prints the same), the habit of answering small results in its head, entries it cannot solve,
and the factory wired into the config."""

from __future__ import annotations

import pytest

from components.config import load_config
from components.contracts.trace import Turn
from components.data.problem_sets import load_tasks
from components.envs.python_tool import PythonTool
from components.envs.reasoning_gym_tir import gym_trace, gym_traces, integer_value
from components.envs.registry import build_env, sft_traces
from components.stages.distill import teacher_tasks

THREE_TERMS = "min_terms=3&max_terms=3&min_digits=2&max_digits=2&operators=['+','*']&whitespace=no_space"


@pytest.mark.parametrize(
    "code, value",
    [
        ("-33*-(-44+-27)", -2343),  # -44 + -27 = -71; -(-71) = 71; -33 * 71 = -2343
        ("7//2", 3),
        ("-7//2", -4),  # floor, as the datasets' eval_floordiv
        ("+(2)*3-10", -4),
    ],
)
def test_integer_value(code, value):
    assert integer_value(code) == value


@pytest.mark.parametrize(
    "code, message",
    [
        ("__import__('os').getcwd()", "not an integer expression"),
        ("2**3", "not an integer expression"),
        ("1/2", "not an integer expression"),
        ("1.5+1", "not an integer expression"),
        ("5//(3-3)", "division by zero"),
        ("print(", "not an expression"),
    ],
)
def test_integer_value_refuses_anything_else(code, message):
    with pytest.raises(ValueError, match=message):
        integer_value(code)


def test_a_trace_prints_the_expression_and_the_sandbox_agrees():
    task = load_tasks(f"reasoning-gym:basic_arithmetic?size=1&{THREE_TERMS}")[0]
    assert task.prompt == "Calculate -33*-(-44+-27)."  # entry 0 of seed 0
    trace = gym_trace(task)
    assert trace.turns == (
        Turn("user", "Calculate -33*-(-44+-27)."),
        Turn("assistant", "", "print(-33*-(-44+-27))"),
        Turn("tool", "-2343\n"),
        Turn("assistant", "\\boxed{-2343}"),
    )
    assert (trace.problem_id, trace.answer) == (task.task_id, -2343)
    assert PythonTool(timeout_s=10.0)("print(-33*-(-44+-27))") == "-2343\n"
    # |-2343| < 2344: answered in its head when every such question is (mental_frac 1), with the tool when none is.
    assert gym_trace(task, mental_max=2344).turns == (trace.turns[0], trace.turns[-1])
    assert gym_trace(task, mental_max=2344, mental_frac=0.0) == trace
    assert gym_trace(task, mental_max=2343) == trace


def test_entries_whose_expression_means_something_else_get_no_trace():
    # Without parentheses basic_arithmetic computes left to right: its answer is not what Python prints.
    tasks = load_tasks(
        "reasoning-gym:basic_arithmetic?size=40&allow_parentheses=false&operators=['+','*']&min_terms=3&max_terms=3"
    )
    unsolved = [t for t in tasks if gym_trace(t) is None]
    assert unsolved and len(unsolved) < len(tasks)
    for task in unsolved:
        entry = task.metadata["reasoning_gym"]["entry"]
        assert integer_value(entry["metadata"]["expression"]) != int(entry["answer"])
    # Of a + b + c, a + b * c, a * b + c and a * b * c only "a + b * c" differs: answered as (a + b) * c.
    for task in unsolved:
        a, rest = task.prompt.removeprefix("Calculate ").removesuffix(".").split(" + ")
        b, c = map(int, rest.split(" * "))
        assert task.answer == str((int(a) + b) * c) != str(int(a) + b * c)
    with pytest.raises(ValueError, match="env.tasks: the reasoning-gym teacher solved none of its 1 tasks"):
        gym_traces(unsolved[:1], 0, 1.0, "env.tasks")


def test_the_factory_is_tir_math_with_this_teacher():
    cfg = load_config(
        "tiny-cpu",
        [
            'env.entrypoint="components.envs.reasoning_gym_tir:factory"',
            f'env.tasks="reasoning-gym:basic_arithmetic?size=20&{THREE_TERMS}"',
            "task.teacher_mental_max=0",
        ],
    )
    setup = build_env(cfg, lambda _: None)
    assert cfg.env.name == "reasoning_gym_tir" and setup.env.name == "tir_math"
    held_out = setup.eval_tasks()
    assert len(held_out) == 200 and all(t.metadata["reasoning_gym"]["seed"] == 1_000_000 for t in held_out)
    traces = sft_traces(cfg)
    assert [t.problem_id for t in traces] == [t.task_id for t in load_tasks(cfg.env.tasks)]
    assert all(len(t.turns) == 4 for t in traces)  # mental_max 0: every answer through the tool
    with pytest.raises(ValueError, match="reasoning_gym_tir needs a reasoning-gym"):
        build_env(load_config("tiny-cpu", ['env.entrypoint="components.envs.reasoning_gym_tir:factory"']), print)


def test_an_endpoint_teacher_solves_the_set_of_a_python_tool_environment_and_refuses_others():
    cfg = load_config(
        "tiny-cpu",
        [
            'env.entrypoint="components.envs.reasoning_gym_tir:factory"',
            f'env.tasks="reasoning-gym:basic_arithmetic?size=12&{THREE_TERMS}"',
        ],
    )
    tasks = teacher_tasks(cfg)
    assert [t.task_id for t in tasks] == [t.task_id for t in load_tasks(cfg.env.tasks)] and len(tasks) == 12
    with pytest.raises(ValueError, match=r"environment 'style' offers tools \[\].*sao train --policy DIR"):
        teacher_tasks(load_config("tiny-cpu", ['env.name="style"']))

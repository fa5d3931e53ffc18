"""The coding environment against the real sandbox: grading, hostile solutions, tool calls, latency."""

from __future__ import annotations

import asyncio
import time

import pytest

from components.chat.markers import parse_turn
from components.contracts.chat import PYTHON_TOOL, Prompt
from components.contracts.markers import CALL, CALL_END, END
from components.contracts.task import Task
from components.envs.coding import (
    CodingEnvironment,
    extract_solution,
    load_coding_tasks,
    parse_harness_output,
    run_tests,
)
from components.envs.latency import ToolLatency

ADD = Task(
    "add-task",
    "Write `def add(a, b)`.",
    {"entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(-4, 6) == 2", "assert add(10, 5) == 15"]},
)


def final(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```{END}"


def grade(code: str, env: CodingEnvironment | None = None, task: Task = ADD):
    env = env or CodingEnvironment([task], timeout_s=2.0)
    return asyncio.run(env.start(task).step(parse_turn(final(code), False), False))


REFERENCE = {
    "add": "def add(a, b):\n    return a + b",
    "is_even": "def is_even(n):\n    return n % 2 == 0",
    "reverse_string": "def reverse_string(s):\n    return s[::-1]",
    "max_of_list": "def max_of_list(xs):\n    return max(xs)",
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
    "factorial": "import math\ndef factorial(n):\n    return math.factorial(n)",
    "fizzbuzz": "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)",
    "is_palindrome": "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]",
    "sum_of_digits": "def sum_of_digits(n):\n    return sum(map(int, str(n)))",
    "unique_sorted": "def unique_sorted(xs):\n    return sorted(set(xs))",
    "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "word_count": "def word_count(s):\n    return len(s.split())",
}


def test_shipped_problems_are_solvable():
    tasks = load_coding_tasks()
    assert 8 <= len(tasks) <= 12 and len({t.task_id for t in tasks}) == len(tasks)
    for task in tasks:
        entry, tests = task.answer["entry_point"], task.answer["tests"]
        assert 3 <= len(tests) <= 5 and entry in task.prompt
        assert run_tests(REFERENCE[entry], entry, tests, 5.0).passed == len(tests), task.task_id
    assert [t.task_id for t in CodingEnvironment().tasks] == [t.task_id for t in tasks]


def test_correct_solution_full_reward():
    result = grade(REFERENCE["add"])
    assert (result.done, result.reward, result.finish_reason) == (True, 1.0, "stop")
    assert (result.info["passed"], result.info["total"]) == (3, 3)
    assert "grading_error" not in result.info


def test_partial_solution_fraction_and_all_pass():
    wrong_on_negatives = "def add(a, b):\n    return a + b if a >= 0 else 0"
    result = grade(wrong_on_negatives)
    assert result.reward == pytest.approx(2 / 3)
    assert (result.info["passed"], result.info["total"]) == (2, 3)
    assert result.info["test_errors"][1].startswith("AssertionError")
    strict = CodingEnvironment([ADD], reward="all_pass", timeout_s=2.0)
    assert grade(wrong_on_negatives, strict).reward == 0.0
    assert grade(REFERENCE["add"], strict).reward == 1.0


def test_printing_solution_still_graded():
    noisy = (
        "import sys\nprint('hello')\ndef add(a, b):\n    print(a, b)\n    print('x', file=sys.stderr)\n    return a + b"
    )
    assert grade(noisy).reward == 1.0


@pytest.mark.parametrize(
    "code, passed",
    [
        ("def add(a, b):\n    if a < 0:\n        raise RuntimeError('boom')\n    return a + b", 2),
        ("def add(a, b):\n    return a + b\nraise RuntimeError('crash at import')", 0),
        ("import sys\ndef add(a, b):\n    sys.exit(0)", 0),
        ("def add(a, b):\n    return a + b\nimport os\nos._exit(0)", 0),
        ("def add(a, b) return a + b", 0),
        ("def plus(a, b):\n    return a + b", 0),
    ],
)
def test_crashing_solutions_get_only_what_they_pass(code, passed):
    result = grade(code)
    assert (result.info["passed"], result.reward) == (passed, passed / 3)


def test_infinite_loops_time_out_per_test():
    loops_on_negatives = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b"
    result = grade(loops_on_negatives)
    assert result.info["passed"] == 2 and result.info["test_errors"][1] == "timeout"
    assert grade("while True:\n    pass\ndef add(a, b):\n    return a + b").reward == 0.0
    # Swallowing the per-test alarm: the runner kills the solution's process after the test's limit plus a
    # grace period, and that test and every later one time out.
    stubborn = (
        "def add(a, b):\n    while True:\n        try:\n            while True:\n                pass\n"
        "        except BaseException:\n            pass"
    )
    t0 = time.monotonic()
    result = grade(stubborn)
    assert (result.reward, result.info["test_errors"]) == (0.0, ["timeout"] * 3)
    assert time.monotonic() - t0 < 5.0


def test_fake_result_marker_is_not_trusted():
    fake = '{"passed": 3, "total": 3, "errors": [null, null, null]}'
    forger = (
        "import os, sys\n"
        f"line = '@@SAO-RESULT-0000@@' + {fake!r} + '\\n'\n"
        "print(line)\nos.write(1, line.encode())\nos.write(2, line.encode())\n"
        "def add(a, b):\n    print(line)\n    return 0"
    )
    result = grade(forger)
    assert (result.reward, result.info["passed"]) == (0.0, 0)
    early_exit = forger + "\nos._exit(0)"
    assert grade(early_exit).reward == 0.0
    # Even a solution that learned the nonce is caught when its line adds to the harness's own one.
    nonce = "ab" * 16
    marker = f"@@SAO-RESULT-{nonce}@@"
    assert parse_harness_output(f"{marker}{fake}\n{marker}{fake}\n", nonce, 3).error is not None
    assert parse_harness_output(f'{marker}{{"passed": 7, "errors": []}}\n', nonce, 3).passed == 0
    assert parse_harness_output(f"{marker}{fake}\n", nonce, 3).passed == 3


def test_extract_solution():
    two_blocks = "try\n```python\nx = 1\n```\nfinal\n```py\ndef f():\n    return 2\n```\nbye"
    assert extract_solution(two_blocks) == "def f():\n    return 2\n"
    assert extract_solution("def f():\n    return 3") == "def f():\n    return 3"
    assert extract_solution("```python\ndef f():\n    return 4\n") == "def f():\n    return 4\n"  # an unclosed fence


def test_tool_call_observation_then_graded_answer():
    env = CodingEnvironment([ADD], timeout_s=2.0)
    episode = env.start(ADD)
    assert episode.prompt() == Prompt("Write `def add(a, b)`.", tools=(PYTHON_TOOL,))
    first = asyncio.run(episode.step(parse_turn(f"Let me check.{CALL}print(2 + 3){CALL_END}", False), False))
    assert (first.done, first.observation) == (False, "5\n")
    error = asyncio.run(episode.step(parse_turn(f"{CALL}1 / 0{CALL_END}", False), False))
    assert error.observation == "ZeroDivisionError: division by zero\n"
    last = asyncio.run(episode.step(parse_turn(final(REFERENCE["add"]), False), False))
    assert (last.reward, last.info["tool_calls"]) == (1.0, 2)


def test_truncated_turn_ends_with_length():
    episode = CodingEnvironment([ADD]).start(ADD)
    result = asyncio.run(episode.step(parse_turn("```python\ndef add(a, b):\n    return a +", True), True))
    assert (result.done, result.reward, result.finish_reason) == (True, 0.0, "length")


def test_lognormal_latency_is_deterministic_and_delays_tool_calls():
    latency = ToolLatency("lognormal", mean_s=0.25, sigma=0.5, seed=7)
    expected = latency.sample(latency.sampler("add-task:0"))
    assert expected == latency.sample(latency.sampler("add-task:0"))
    assert expected != latency.sample(latency.sampler("add-task:1"))
    assert expected > 0.05
    episode = CodingEnvironment([ADD], latency=latency).start(ADD)
    t0 = time.monotonic()
    asyncio.run(episode.step(parse_turn(f"{CALL}print(1){CALL_END}", False), False))
    assert time.monotonic() - t0 >= expected


def test_tool_calls_run_concurrently():
    env = CodingEnvironment([ADD], latency=ToolLatency("fixed", mean_s=0.3))

    async def one():
        return await env.start(ADD).step(
            parse_turn(f"{CALL}import time; time.sleep(0.5); print('ok'){CALL_END}", False), False
        )

    async def four():
        return await asyncio.gather(*(one() for _ in range(4)))

    t0 = time.monotonic()
    results = asyncio.run(four())
    assert all(r.observation == "ok\n" for r in results)
    assert time.monotonic() - t0 < 4 * 0.8 / 2  # serial would take >= 3.2 s


def test_malformed_tasks_rejected():
    with pytest.raises(ValueError, match="task bad: answer.tests"):
        CodingEnvironment([Task("bad", "p", {"entry_point": "f", "tests": []})])
    with pytest.raises(ValueError, match="task bad: answer must be a dict"):
        CodingEnvironment([Task("bad", "p", 3)])
    with pytest.raises(ValueError, match="reward"):
        CodingEnvironment([ADD], reward="mean")

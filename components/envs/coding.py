"""`coding`: write a Python function that passes hidden tests.

A task's answer is `{"entry_point": "add", "tests": ["assert add(1, 2) == 3", ...]}`. The model may make
Python tool calls (run in the sandbox exactly like TIR) as often as it likes; its final turn holds the solution:
the last ```python (or ```py / bare ```) fenced block of the turn's content, else the whole content.

Grading is one sandbox call (`coding_harness.harness_program`, where the design is described): the hidden
tests run in one process (the runner), the solution in another (a fresh interpreter that never holds the
tests), and the tests call the solution's entry point through a pipe that carries only plain data. The
runner writes one result line, `@@SAO-RESULT-<nonce>@@{json}`, on its stdout, which the solution's process
cannot reach; the nonce is fresh per grading. No such line, or more than one, counts as 0 passed. So a
solution can neither read the tests, nor fake a pass (printing a result, `os._exit(0)`, `sys.exit`, patching
builtins or `assert`), nor return an object whose `__eq__` always holds.

Reward: `fraction` = passed / total; `all_pass` = 1.0 when every test passes, else 0.0.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.environment import StepResult
from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.data.problem_sets import load_tasks
from components.envs.coding_harness import RESULT_MARKER, harness_program
from components.envs.latency import ToolLatency
from components.envs.python_tool import PythonTool
from components.envs.tool_calls import TOOLS, MalformedCalls, call_problem, check_mode, malformed_step
from components.sandbox.run import DEFAULT_PACKAGES, SandboxError, run_python

DEFAULT_PROBLEMS = Path(__file__).resolve().parents[2] / "data" / "coding" / "problems.jsonl"
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def coding_spec(task: Task) -> tuple[str, list[str]]:
    """`(entry_point, tests)` of a coding task; ValueError naming the task when the answer is malformed."""
    answer = task.answer
    if not isinstance(answer, dict):
        raise ValueError(f"task {task.task_id}: answer must be a dict with entry_point and tests")
    entry, tests = answer.get("entry_point"), answer.get("tests")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ValueError(f"task {task.task_id}: answer.entry_point must be an identifier, got {entry!r}")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise ValueError(f"task {task.task_id}: answer.tests must be a non-empty list of strings")
    return entry, list(tests)


def load_coding_tasks(path: str | Path | None = None) -> list[Task]:
    """Coding tasks from JSONL/Parquet rows `{task_id, prompt, answer: {entry_point, tests}, ...}`.

    The default is the small shipped set `data/coding/problems.jsonl`. Every answer is validated. A
    `solution` column (a reference solution, needed by `solution_trace`) moves into the answer, which the
    model never sees and trajectories do not copy; other columns land in `Task.metadata`.
    """
    tasks = load_tasks(path or DEFAULT_PROBLEMS, prompt_field="prompt", answer_field="answer", id_field="task_id")
    for task in tasks:
        coding_spec(task)
    return [_solution_into_answer(task) for task in tasks]


def _solution_into_answer(task: Task) -> Task:
    if "solution" not in task.metadata:
        return task
    metadata = {k: v for k, v in task.metadata.items() if k != "solution"}
    return Task(task.task_id, task.prompt, {**task.answer, "solution": task.metadata["solution"]}, metadata)


def solution_trace(task: Task) -> Trace:
    """The SFT trace of a coding task: one answer turn holding the reference solution in a ```python block.

    The solution is the row's `solution` column (`Task.answer["solution"]` after `load_coding_tasks`; the
    shipped set has one per row, tests/envs/test_registry.py runs each against its hidden tests);
    ValueError naming the task when it is missing. `answer` is None: coding traces are graded by tests, not
    by an integer.
    """
    solution = task.answer.get("solution") if isinstance(task.answer, dict) else None
    if not isinstance(solution, str) or not solution.strip():
        raise ValueError(
            f"task {task.task_id}: field 'solution' (a reference solution string) is missing or "
            "empty; the coding SFT teacher needs one per task"
        )
    answer = f"```python\n{solution.strip()}\n```"
    return Trace(task.task_id, (Turn("user", task.prompt), Turn("assistant", answer)), None)


def extract_solution(text: str) -> str:
    """The code of a final turn's content: its last fenced block, else the whole content."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@dataclass(frozen=True)
class Grade:
    passed: int
    """Tests that passed (0 when no trustworthy result came back)."""
    total: int
    """Tests run."""
    error: str | None = None
    """Why nothing could be counted (no or several result lines, timeout), else None."""
    test_errors: tuple[str | None, ...] = ()
    """Per test: None when it passed, else a short `Type: message` (or `timeout`)."""


def parse_harness_output(stdout: str, nonce: str, total: int) -> Grade:
    """The grade in the harness's stdout; 0 passed with an error unless there is exactly one valid line."""
    marker = RESULT_MARKER.format(nonce=nonce)
    lines = [line[len(marker) :] for line in stdout.splitlines() if line.startswith(marker)]
    if len(lines) != 1:
        return Grade(0, total, f"expected one result line, found {len(lines)}")
    try:
        result = json.loads(lines[0])
        passed, errors = result["passed"], result["errors"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return Grade(0, total, "malformed result line")
    if isinstance(passed, bool) or not isinstance(passed, int) or not 0 <= passed <= total:
        return Grade(0, total, f"passed out of range: {passed!r}")
    return Grade(passed, total, None, tuple(errors) if isinstance(errors, list) else ())


def run_tests(solution: str, entry_point: str, tests: list[str], timeout_s: float) -> Grade:
    """Grade `solution` against `tests` in one blocking sandbox call (`timeout_s` wall limit)."""
    nonce = secrets.token_hex(16)
    # Leave ~0.5 s of the wall limit for interpreter start-up; the rest is shared by the load and each test.
    limit_s = max(0.05, (timeout_s - 0.5) / (len(tests) + 1))
    result = run_python(harness_program(solution, entry_point, tests, limit_s, nonce), timeout_s=timeout_s)
    grade = parse_harness_output(result.stdout, nonce, len(tests))
    if grade.error and result.timed_out:
        return Grade(0, len(tests), "timed out")
    return grade


class CodingEnvironment:
    """Function-writing tasks graded by hidden tests (see the module docstring)."""

    name = "coding"
    success_threshold = 1.0  # every hidden test passed

    def __init__(
        self,
        tasks: list[Task] | None = None,
        latency: ToolLatency | None = None,
        reward: Literal["fraction", "all_pass"] = "fraction",
        timeout_s: float = 5.0,
        max_output_chars: int = 256,
        malformed_calls: MalformedCalls = "observe",
        packages: tuple[str, ...] = DEFAULT_PACKAGES,
    ) -> None:
        if reward not in ("fraction", "all_pass"):
            raise ValueError(f"reward must be 'fraction' or 'all_pass', got {reward!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.tasks = load_coding_tasks() if tasks is None else list(tasks)
        for task in self.tasks:
            coding_spec(task)
        self.latency = latency if latency is not None else ToolLatency()
        self.reward, self.timeout_s = reward, timeout_s
        self.tool = PythonTool(timeout_s=timeout_s, max_chars=max_output_chars, packages=packages)
        self.malformed_calls = check_mode(malformed_calls)

    def start(self, task: Task) -> CodingEpisode:
        """A fresh episode; ValueError when the task's answer is not a coding spec."""
        return CodingEpisode(self, task)


class CodingEpisode:
    """One coding episode: tool calls until a final turn, which is graded."""

    def __init__(self, env: CodingEnvironment, task: Task) -> None:
        self.env, self.task = env, task
        self.entry_point, self.tests = coding_spec(task)
        self.tool_calls = 0

    def prompt(self) -> Prompt:
        return Prompt(self.task.prompt, tools=TOOLS)

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        """Run a tool call, or grade the final turn; a truncated turn ends the episode unrewarded."""
        info: dict = {"tool_calls": self.tool_calls}
        if truncated:
            return StepResult(None, True, 0.0, "length", info)
        problem = call_problem(turn)
        if problem is not None:
            return malformed_step(problem, self.env.malformed_calls, info)
        if turn.call is not None:
            code = turn.call.arguments["code"]
            await self.env.latency.wait(self.env.latency.sampler(f"{self.task.task_id}:{self.tool_calls}"))
            self.tool_calls += 1
            try:
                output = await asyncio.to_thread(self.env.tool, code)
            except SandboxError as exc:
                return StepResult(None, True, 0.0, "tool_error", {"tool_calls": self.tool_calls, "error": str(exc)})
            return StepResult(output, False)
        try:
            grade = await asyncio.to_thread(
                run_tests, extract_solution(turn.content), self.entry_point, self.tests, self.env.timeout_s
            )
        except SandboxError as exc:
            return StepResult(None, True, 0.0, "tool_error", {**info, "error": str(exc)})
        if self.env.reward == "fraction":
            reward = grade.passed / grade.total
        else:
            reward = float(grade.passed == grade.total)
        info.update(passed=grade.passed, total=grade.total, test_errors=list(grade.test_errors))
        if grade.error:
            info["grading_error"] = grade.error
        return StepResult(None, True, reward, "stop", info)

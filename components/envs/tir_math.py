"""`tir_math`: tool-integrated math. The model writes Python in a tool call, the sandbox runs it, and the
output comes back as an observation. An exactly correct `\\boxed{}` answer earns reward 1.

The synthetic arithmetic set (components.data.tasks) is the embedded data. Real problem sets (JSONL or
Parquet with problem and answer columns) load through `components.data.problem_sets.load_tasks`. Tasks from a
reasoning-gym dataset are scored by the dataset's own `score_answer` on the boxed answer (a reward in [0, 1],
solved at `success_threshold`); every other task by `components.envs.grading`.
"""

from __future__ import annotations

import asyncio

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.environment import StepResult
from components.contracts.task import Task
from components.data.reasoning_gym_tasks import gym_score, is_gym_task
from components.data.tasks import Problem
from components.envs.grading import extract_boxed, grade_answer, task_reference
from components.envs.latency import NO_LATENCY, ToolLatency
from components.envs.python_tool import PythonTool
from components.envs.tool_calls import TOOLS, MalformedCalls, call_problem, check_mode, malformed_step
from components.sandbox.run import DEFAULT_PACKAGES


def tasks_from_problems(problems: list[Problem]) -> list[Task]:
    return [Task(p.problem_id, p.question, p.answer, {"kind": p.kind}) for p in problems]


class TIRMathEnvironment:
    name = "tir_math"
    success_threshold = 1.0  # an exactly correct answer

    def __init__(
        self,
        tool_timeout_s: float = 5.0,
        latency: ToolLatency = NO_LATENCY,
        max_output_chars: int = 256,
        malformed_calls: MalformedCalls = "observe",
        packages: tuple[str, ...] = DEFAULT_PACKAGES,
    ) -> None:
        self.tool = PythonTool(timeout_s=tool_timeout_s, max_chars=max_output_chars, packages=packages)
        self.latency = latency
        self.malformed_calls = check_mode(malformed_calls)

    def start(self, task: Task) -> TIRMathEpisode:
        return TIRMathEpisode(self, task)


class TIRMathEpisode:
    def __init__(self, env: TIRMathEnvironment, task: Task) -> None:
        self.env, self.task = env, task
        self.tool_calls = 0

    def prompt(self) -> Prompt:
        return Prompt(self.task.prompt, tools=TOOLS)

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        if truncated:
            return StepResult(None, True, 0.0, "length", {"tool_calls": self.tool_calls})
        problem = call_problem(turn)
        if problem is not None:
            return malformed_step(problem, self.env.malformed_calls, {"tool_calls": self.tool_calls})
        if turn.call is not None:
            rng = self.env.latency.sampler(f"{self.task.task_id}:{self.tool_calls}")
            await self.env.latency.wait(rng)
            self.tool_calls += 1
            output = await asyncio.to_thread(self.env.tool, turn.call.arguments["code"])
            return StepResult(output, False)
        # in a thread: math-verify may take up to its deadline on an odd answer, and the loop runs other episodes
        reward = await asyncio.to_thread(self._grade, turn.content) if turn.ended else 0.0
        correct = reward >= self.env.success_threshold
        return StepResult(None, True, reward, "stop", {"correct": correct, "tool_calls": self.tool_calls})

    def _grade(self, text: str) -> float:
        if is_gym_task(self.task):
            boxed = extract_boxed(text)
            return gym_score(self.task, None if boxed is None else boxed.strip())
        return float(grade_answer(text, task_reference(self.task)))

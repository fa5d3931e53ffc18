"""`tir_math`: tool-integrated math. The model writes Python in a tool call, the sandbox runs it, and the
output comes back as an observation. An exactly correct `\\boxed{}` answer earns reward 1.

The synthetic arithmetic set (components.data.tasks) is the embedded data. Real problem sets (JSONL or
Parquet with problem and answer columns) load through `components.data.problem_sets.load_tasks`.
"""

from __future__ import annotations

import asyncio

from components.contracts.environment import StepResult
from components.contracts.markers import (
    CALL,
    CALL_END,
    END,
    observation_text,
    prompt_text,
)
from components.contracts.task import Task
from components.data.tasks import Problem
from components.envs.grading import grade_answer, reference_answer
from components.envs.latency import NO_LATENCY, ToolLatency
from components.envs.python_tool import PythonTool


def tasks_from_problems(problems: list[Problem]) -> list[Task]:
    return [Task(p.problem_id, p.question, p.answer, {"kind": p.kind}) for p in problems]


def last_tool_code(turn_text: str) -> str:
    """Code between the last `<|python|>` and the closing `<|/python|>` of a turn."""
    begin = turn_text.rfind(CALL)
    return turn_text[begin + len(CALL) : turn_text.rfind(CALL_END)] if begin >= 0 else ""


class TIRMathEnvironment:
    name = "tir_math"
    success_threshold = 1.0  # an exactly correct answer

    def __init__(
        self, tool_timeout_s: float = 5.0, latency: ToolLatency = NO_LATENCY, max_output_chars: int = 256
    ) -> None:
        self.tool = PythonTool(timeout_s=tool_timeout_s, max_chars=max_output_chars)
        self.latency = latency

    def start(self, task: Task) -> TIRMathEpisode:
        return TIRMathEpisode(self, task)


class TIRMathEpisode:
    def __init__(self, env: TIRMathEnvironment, task: Task) -> None:
        self.env, self.task = env, task
        self.tool_calls = 0

    def prompt_text(self) -> str:
        return prompt_text(self.task.prompt)

    async def step(self, turn_text: str, truncated: bool) -> StepResult:
        if truncated:
            return StepResult(None, True, 0.0, "length", {"tool_calls": self.tool_calls})
        if turn_text.endswith(CALL_END):
            code = last_tool_code(turn_text)
            rng = self.env.latency.sampler(f"{self.task.task_id}:{self.tool_calls}")
            await self.env.latency.wait(rng)
            self.tool_calls += 1
            output = await asyncio.to_thread(self.env.tool, code)
            return StepResult(observation_text(output), False)
        correct = turn_text.endswith(END) and grade_answer(turn_text, reference_answer(self.task.answer))
        return StepResult(None, True, float(correct), "stop", {"correct": correct, "tool_calls": self.tool_calls})

"""Distillation: a teacher writes the SFT traces, the gate checks them, and they become a versioned dataset.

    teacher (programmatic, or a chat endpoint with tool calling) -> traces -> gate -> data/sft-<env>-<hash>/

The dataset's key is a hash of what shaped it (environment, the task fields of the training problems, and the
teacher when it is an endpoint), so a new teacher or problem set is a new dataset version and the same inputs
reuse the complete one in the home or the store. The directory holds `traces.parquet` and `gate.json` (the gate's
report); a dataset that fails its gate is never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from components.config import Config
from components.contracts.chat import PYTHON_TOOL
from components.contracts.task import Task
from components.contracts.trace import Trace
from components.data.gates import check_traces
from components.data.problem_sets import load_tasks
from components.data.tasks import generate_problems
from components.data.teacher_client import TeacherEndpoint, distill
from components.data.traces import read_traces, write_traces
from components.envs.grading import grade_answer
from components.envs.python_tool import PythonTool
from components.envs.registry import env_tools, sft_traces
from components.envs.sandbox_check import check_sandbox
from components.envs.tir_math import tasks_from_problems
from components.models import start_chat
from components.stages.home import Log, available, publish
from components.stages.recipes import data_recipe, dataset_key
from components.storage import atomic_dir, write_json

if TYPE_CHECKING:
    from components.data.gates import GateReport

Progress = Callable[[int, int], None]


@dataclass
class Distilled:
    traces: list[Trace]
    """Kept traces, in problem order."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Problems whose trace was not kept, by reason (wrong answer, turn limit, ...)."""
    seconds: float = 0.0
    """Teacher time."""


def teacher_tasks(cfg: Config) -> list[Task]:
    """The problems an endpoint teacher solves: `env.tasks` when set, else tir_math's synthetic training split.

    The teacher client drives the Python tool and grades the final `\\boxed{}` answer against the task's reference,
    so it distils environments whose episodes offer that tool alone: tir_math, and any other one (e.g.
    reasoning_gym_tir) on an `env.tasks` set with reference answers."""
    if cfg.env.name != "tir_math":
        tools = env_tools(cfg)
        if tools != (PYTHON_TOOL,) or not cfg.env.tasks:
            offered = [schema.get("function", {}).get("name") for schema in tools]
            raise ValueError(
                f"distill.teacher: an endpoint teacher solves problems with the Python tool and is graded on their "
                f"reference answers; the environment {cfg.env.name!r} offers tools {offered}"
                + ("" if cfg.env.tasks else " and env.tasks names no problem set")
                + ": use its programmatic teacher (distill.teacher = 'programmatic') or start RL from a policy "
                "(sao train --policy DIR)"
            )
    if cfg.env.tasks:
        return load_tasks(cfg.env.tasks)
    t = cfg.task
    return tasks_from_problems(generate_problems(t.kinds, t.train_size, t.seed, t.operand_max, "train"))


def write_teacher_traces(cfg: Config, log: Log = print, progress: Progress | None = None) -> Distilled:
    """The teacher's traces: the environment's programmatic teacher, or the endpoint in `distill.teacher` driven
    through the tool-calling client (tool calls run in the sandbox), wrong answers rejected."""
    start = time.perf_counter()
    if cfg.distill.teacher == "programmatic":
        traces = sft_traces(cfg)
        log(f"distill: programmatic {cfg.env.name} teacher wrote {len(traces)} traces")
        return Distilled(traces, {}, time.perf_counter() - start)

    check_sandbox(cfg.rollout.sandbox_degraded, cfg.rollout.tool_packages, log)  # the teacher's tool calls run there
    tasks = teacher_tasks(cfg)
    endpoint = TeacherEndpoint.from_config(cfg.distill)
    log(
        f"distill: {len(tasks)} problems to {cfg.distill.model} at {cfg.distill.teacher}, "
        f"{cfg.distill.concurrency} in flight"
    )
    result = distill(
        endpoint,
        tasks,
        PythonTool(timeout_s=cfg.rollout.tool_timeout_s, packages=cfg.rollout.tool_packages),
        cfg.distill.max_turns,
        cfg.distill.concurrency,
        progress=progress,
        grade=grade_answer,
    )
    rejected = {reason: n for reason, n in result.rejected.items() if n and reason != "accepted"}
    log(f"distill: kept {len(result.traces)} traces, rejected {rejected or 'none'} in {result.seconds:.1f}s")
    return Distilled(list(result.traces), rejected, result.seconds)


def gate_traces(cfg: Config, traces: list[Trace]) -> GateReport:
    """The trace gate (components/data/gates.py) with this config's bounds."""
    return check_traces(
        traces,
        start_chat(cfg.model),
        max_tokens=cfg.rollout.max_total_tokens,
        grade=grade_answer,
        tools=env_tools(cfg),
    )


def save_dataset(cfg: Config, home: Path, distilled: Distilled, report: GateReport, log: Log = print) -> Path:
    """Write a gated dataset under its key and publish it; returns the traces' path."""
    key, recipe = dataset_key(cfg), data_recipe(cfg)
    with atomic_dir(Path(home) / key) as tmp:
        write_traces(tmp / "traces.parquet", distilled.traces)
        write_json(tmp / "gate.json", report.to_dict())
        write_json(
            tmp / "dataset.json",
            {
                "recipe": recipe,
                "traces": len(distilled.traces),
                "rejected": distilled.rejected,
                "teacher_seconds": distilled.seconds,
            },
        )
    path = Path(home) / key / "traces.parquet"
    log(f"data: wrote {len(distilled.traces)} {cfg.env.name} traces to {path}")
    publish(cfg.store, home, key, log)
    return path


def existing_dataset(cfg: Config, home: Path, log: Log = print) -> Path | None:
    """The complete dataset for this config in the home (fetched from the store if only there), else None."""
    key = dataset_key(cfg)
    if not available(cfg.store, home, key, log):
        return None
    publish(cfg.store, home, key, log, again=False)
    return Path(home) / key / "traces.parquet"


def run_distill(cfg: Config, home: Path, log: Log = print) -> Path:
    """Teacher -> gate -> dataset, or the complete dataset already made from the same inputs. A failing gate raises
    `GateFailed` naming each failing expectation and its first offending rows; nothing is written then."""
    path = existing_dataset(cfg, home, log)
    if path is not None:
        log(f"data: reusing {path}")
        return path
    distilled = write_teacher_traces(cfg, log)
    report = gate_traces(cfg, distilled.traces)
    log(f"gate: {report.summary()}")
    report.raise_if_failed()
    return save_dataset(cfg, home, distilled, report, log)


def dataset_rows(path: Path) -> list[dict]:
    """A light view of a dataset for MLflow's dataset input (ids, answers, turn counts)."""
    return [{"problem_id": t.problem_id, "answer": t.answer, "turns": len(t.turns)} for t in read_traces(path)]

"""Environments chosen by config: `build_env(cfg)` is the environment named by `cfg.env.name` with its
training stream, held-out set and per-step hook; `sft_traces(cfg)` is its teacher's SFT data.

`ENVIRONMENTS` is one plain dict keyed by the `env.name` literal (STYLE principle 12). Building one that runs
model-written code (tir_math, coding) checks the sandbox first: `rollout.sandbox_degraded` (sandbox_check.py).

Training streams are pure functions of (seed, start), so a run resumed from the cursor a checkpoint stores
continues exactly:

- tir_math, built-in: the synthetic training split of `train.task_seed`, generated in chunks of 4096, ids
  `rl-{index}`: the trainer's original `task_stream`, so existing runs reproduce bit for bit.
- every other set (a file or URI in `env.tasks`; the small built-in coding and style sets) is cycled: epoch
  `e` visits each task once, in an order shuffled by `Random(f"{train.task_seed}:{e}")`, ids
  `{task_id}@{index}`.

SFT teachers: tir_math's programmatic TIR teacher on the synthetic training split (also when `env.tasks`
names a real problem set: the programmatic teacher only solves synthetic problems); style's phrase teacher
(`style_teacher`) over the training prompts; coding's reference solutions (the `solution` column).
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from components.config import Config, EnvConfig
from components.contracts.environment import EnvSetup, Prompts
from components.contracts.task import Task
from components.contracts.trace import Trace
from components.data.problem_sets import load_tasks
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.envs.coding import CodingEnvironment, load_coding_tasks, solution_trace
from components.envs.latency import ToolLatency
from components.envs.sandbox_check import check_sandbox
from components.envs.style import (
    LexicalJudge,
    LLMJudge,
    PreferenceSchedule,
    StyleEnvironment,
    StyleJudge,
    load_style_tasks,
)
from components.envs.style_teacher import style_traces
from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems
from components.envs.tool_calls import TOOLS

SYNTHETIC_CHUNK = 4096
"""Problems generated at a time by the synthetic stream (changing it changes nothing but speed)."""


def synthetic_prompts(kinds: tuple[str, ...], seed: int, operand_max: int, start: int) -> Iterator[tuple[int, Task]]:
    """The built-in tir_math stream from `start` on: training-split problem `index` as task `rl-{index}`."""
    for offset in itertools.count(start - start % SYNTHETIC_CHUNK, SYNTHETIC_CHUNK):
        problems = generate_problems(kinds, offset + SYNTHETIC_CHUNK, seed, operand_max, "train")[offset:]
        for index, p in enumerate(problems, start=offset):
            if index >= start:
                yield index, Task(f"rl-{index}", p.question, p.answer, {"kind": p.kind})


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the `n` tasks of a cycled set."""
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)  # str seeds hash with SHA-512: stable across processes
    return order


def cycled_prompts(tasks: list[Task], seed: int, start: int) -> Iterator[tuple[int, Task]]:
    """A finite set cycled from `start` on, reshuffled per epoch (`epoch_order`); ids `{task_id}@{index}`."""
    n = len(tasks)
    if n == 0:
        raise ValueError("tasks: cannot cycle an empty training set")
    for epoch in itertools.count(start // n):
        order = epoch_order(n, seed, epoch)
        for position in range(max(start - epoch * n, 0), n):
            index, task = epoch * n + position, tasks[order[position]]
            yield index, Task(f"{task.task_id}@{index}", task.prompt, task.answer, dict(task.metadata))


def judge_from(judge: str, model: str) -> StyleJudge:
    """`lexical` -> `LexicalJudge`; an http(s) base URL -> `LLMJudge(judge, model)`."""
    if judge == "lexical":
        return LexicalJudge()
    if judge.startswith(("http://", "https://")):
        if not model.strip():
            raise ValueError(f"env.judge_model: required when env.judge is a URL ({judge})")
        return LLMJudge(judge, model)
    raise ValueError(f"env.judge: must be 'lexical' or an http:// or https:// base URL, got {judge!r}")


def _latency(cfg: Config) -> ToolLatency:
    return ToolLatency(cfg.rollout.latency, cfg.rollout.latency_mean_s, cfg.rollout.latency_sigma, cfg.task.seed)


def _cycled(tasks: list[Task], cfg: Config) -> Prompts:
    if not tasks:
        raise ValueError(f"env.tasks: the training set {cfg.env.tasks or '(built-in)'} holds no tasks")
    return functools.partial(cycled_prompts, tasks, cfg.train.task_seed)


def _tir_math(cfg: Config) -> EnvSetup:
    env = TIRMathEnvironment(
        cfg.rollout.tool_timeout_s,
        _latency(cfg),
        malformed_calls=cfg.env.malformed_calls,
        packages=cfg.rollout.tool_packages,
    )
    if cfg.env.tasks:
        prompts = _cycled(load_tasks(cfg.env.tasks), cfg)
    else:
        prompts = functools.partial(synthetic_prompts, cfg.task.kinds, cfg.train.task_seed, cfg.task.operand_max)

    def held_out() -> list[Task]:
        if cfg.env.eval_tasks:
            return load_tasks(cfg.env.eval_tasks)
        return tasks_from_problems(
            generate_problems(cfg.task.kinds, cfg.task.eval_size, cfg.task.seed, cfg.task.operand_max, "eval")
        )

    return EnvSetup("tir_math", env, prompts, held_out)


def _coding(cfg: Config) -> EnvSetup:
    tasks = load_coding_tasks(cfg.env.tasks or None)
    env = CodingEnvironment(
        tasks,
        latency=_latency(cfg),
        timeout_s=cfg.rollout.tool_timeout_s,
        malformed_calls=cfg.env.malformed_calls,
        packages=cfg.rollout.tool_packages,
    )
    return EnvSetup("coding", env, _cycled(tasks, cfg), lambda: load_coding_tasks(cfg.env.eval_tasks or None))


def _style(cfg: Config) -> EnvSetup:
    tasks = load_style_tasks(cfg.env.tasks or None)
    phases = cfg.env.preference_phases
    env = StyleEnvironment(tasks, judge_from(cfg.env.judge, cfg.env.judge_model), preferred=phases[0][0])
    return EnvSetup(
        "style",
        env,
        _cycled(tasks, cfg),
        lambda: load_style_tasks(cfg.env.eval_tasks or None),
        PreferenceSchedule(env, phases).on_step,
    )


def _tir_math_traces(cfg: Config) -> list[Trace]:
    problems = generate_problems(cfg.task.kinds, cfg.task.train_size, cfg.task.seed, cfg.task.operand_max, "train")
    return [teacher_trace(p, cfg.task.teacher_mental_max, cfg.task.teacher_mental_frac) for p in problems]


def _style_traces(cfg: Config) -> list[Trace]:
    return style_traces(load_style_tasks(cfg.env.tasks or None), cfg.task.train_size, cfg.task.seed)


def _coding_traces(cfg: Config) -> list[Trace]:
    return [solution_trace(task) for task in load_coding_tasks(cfg.env.tasks or None)]


@dataclass(frozen=True)
class EnvKind:
    build: Callable[[Config], EnvSetup]
    """Builds the environment with its streams from the config."""
    teacher: Callable[[Config], list[Trace]]
    """Writes the SFT traces: tir_math `task.train_size` TIR traces; style `task.train_size` answers of
    uniformly mixed styles; coding one reference-solution trace per training task."""
    tools: tuple[dict, ...] = ()
    """The tool schemas its episodes offer (`Prompt.tools`): SFT renders its traces' prompts with them."""
    sandboxed: bool = False
    """Its episodes run model-written code in the sandbox (tool calls, grading): `build_env` checks the sandbox
    first (`rollout.sandbox_degraded`)."""


ENVIRONMENTS: dict[str, EnvKind] = {
    "tir_math": EnvKind(_tir_math, _tir_math_traces, TOOLS, sandboxed=True),
    "coding": EnvKind(_coding, _coding_traces, TOOLS, sandboxed=True),
    "style": EnvKind(_style, _style_traces),
}


def _kind(name: str) -> EnvKind:
    if name not in ENVIRONMENTS:
        raise ValueError(f"env.name: unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


def build_env(cfg: Config, log: Callable[[str], None] = print) -> EnvSetup:
    """The environment `cfg.env.name` names, with its training stream, held-out set and step hook. One that runs
    model-written code checks the sandbox first (`sandbox_check.check_sandbox`): under `rollout.sandbox_degraded =
    "refuse"` a run on a host without the sandbox's namespaces stops here, before anything else starts; under
    "warn" it says so in `log`."""
    kind = _kind(cfg.env.name)
    if kind.sandboxed:
        check_sandbox(cfg.rollout.sandbox_degraded, cfg.rollout.tool_packages, log)
    return kind.build(cfg)


def env_tools(env: EnvConfig) -> tuple[dict, ...]:
    """The tool schemas of `env.name`'s episodes (see `EnvKind.tools`)."""
    return _kind(env.name).tools


def sft_traces(cfg: Config) -> list[Trace]:
    """The teacher traces SFT imitates for `cfg.env.name` (see `EnvKind.teacher`)."""
    return _kind(cfg.env.name).teacher(cfg)

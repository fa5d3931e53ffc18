"""The built-in environments as factories, registered in the `sao.environments` entry-point group
(pyproject.toml) exactly as a package's would be: `tir_math`, `coding` and `style`, each `factory(options,
context) -> EnvSetup` reading the run's config (components/contracts/environment.py).

- tir_math: the synthetic training split of `train.task_seed`, generated in chunks of 4096, ids `rl-{index}`
  (the trainer's original stream, so existing runs reproduce bit for bit), or the problem set `env.tasks` names;
  its programmatic TIR teacher writes `task.train_size` traces on the synthetic training split (also when
  `env.tasks` names a real set: the programmatic teacher only solves synthetic problems).
- coding: the small built-in set or `env.tasks`; SFT imitates the reference solutions (the `solution` column).
- style: the built-in prompts or `env.tasks`, judged by `env.judge`; SFT is the phrase teacher (`style_teacher`)
  over the training prompts; the preference schedule is its step hook.

Their training sets other than tir_math's synthetic stream are task lists: the registry cycles them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

from components.config import Config
from components.contracts.environment import EnvContext, EnvSetup
from components.contracts.task import Task
from components.contracts.trace import Trace
from components.data.problem_sets import load_tasks
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.envs.coding import CodingEnvironment, load_coding_tasks, solution_trace
from components.envs.latency import ToolLatency
from components.envs.style import (
    GradedJudge,
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


def judge_from(judge: str, model: str) -> StyleJudge:
    """`lexical` -> `LexicalJudge`; `graded` -> `GradedJudge`; an http(s) base URL -> `LLMJudge(judge, model)`."""
    if judge == "lexical":
        return LexicalJudge()
    if judge == "graded":
        return GradedJudge()
    if judge.startswith(("http://", "https://")):
        if not model.strip():
            raise ValueError(f"env.judge_model: required when env.judge is a URL ({judge})")
        return LLMJudge(judge, model)
    raise ValueError(f"env.judge: must be 'lexical', 'graded' or an http:// or https:// base URL, got {judge!r}")


def _no_options(name: str, options: dict) -> None:
    if options:
        raise ValueError(
            f"env.options: the built-in {name} environment takes no options (its settings are the config's "
            f"env, task and rollout sections), got {sorted(options)}"
        )


def _latency(cfg: Config) -> ToolLatency:
    return ToolLatency(cfg.rollout.latency, cfg.rollout.latency_mean_s, cfg.rollout.latency_sigma, cfg.task.seed)


def _tir_math_traces(cfg: Config) -> list[Trace]:
    problems = generate_problems(cfg.task.kinds, cfg.task.train_size, cfg.task.seed, cfg.task.operand_max, "train")
    return [teacher_trace(p, cfg.task.teacher_mental_max, cfg.task.teacher_mental_frac) for p in problems]


def tir_math(options: dict, context: EnvContext) -> EnvSetup:
    """Tool-integrated arithmetic (or the math problem set `env.tasks` names), graded against the answer."""
    _no_options("tir_math", options)
    cfg = context.config
    env = TIRMathEnvironment(
        cfg.rollout.tool_timeout_s,
        _latency(cfg),
        malformed_calls=cfg.env.malformed_calls,
        packages=cfg.rollout.tool_packages,
    )
    if cfg.env.tasks:
        prompts = load_tasks(cfg.env.tasks)
    else:
        prompts = functools.partial(synthetic_prompts, cfg.task.kinds, cfg.train.task_seed, cfg.task.operand_max)

    def held_out() -> list[Task]:
        if cfg.env.eval_tasks:
            return load_tasks(cfg.env.eval_tasks)
        return tasks_from_problems(
            generate_problems(cfg.task.kinds, cfg.task.eval_size, cfg.task.seed, cfg.task.operand_max, "eval")
        )

    return EnvSetup(
        "tir_math",
        env,
        prompts,
        held_out,
        tools=TOOLS,
        teacher=functools.partial(_tir_math_traces, cfg),
        sandboxed=True,
    )


def coding(options: dict, context: EnvContext) -> EnvSetup:
    """Write a function that passes hidden tests, run in the sandbox."""
    _no_options("coding", options)
    cfg = context.config
    tasks = load_coding_tasks(cfg.env.tasks or None)
    env = CodingEnvironment(
        tasks,
        latency=_latency(cfg),
        timeout_s=cfg.rollout.tool_timeout_s,
        malformed_calls=cfg.env.malformed_calls,
        packages=cfg.rollout.tool_packages,
    )
    return EnvSetup(
        "coding",
        env,
        tasks,
        lambda: load_coding_tasks(cfg.env.eval_tasks or None),
        tools=TOOLS,
        teacher=lambda: [solution_trace(task) for task in tasks],
        sandboxed=True,
    )


def style(options: dict, context: EnvContext) -> EnvSetup:
    """Answer in the preferred style, which the preference schedule shifts during the run."""
    _no_options("style", options)
    cfg = context.config
    tasks = load_style_tasks(cfg.env.tasks or None)
    phases = cfg.env.preference_phases
    env = StyleEnvironment(tasks, judge_from(cfg.env.judge, cfg.env.judge_model), preferred=phases[0][0])
    return EnvSetup(
        "style",
        env,
        tasks,
        lambda: load_style_tasks(cfg.env.eval_tasks or None),
        PreferenceSchedule(env, phases).on_step,
        teacher=lambda: style_traces(tasks, cfg.task.train_size, cfg.task.seed),
    )

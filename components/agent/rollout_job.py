"""`sao rollout`: run episodes of one environment with the SFT policy on the embedded engine, write Parquet."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from components.agent.runner import AgentRunner, EpisodeLimits
from components.config import Config
from components.contracts.trajectory import Trajectory, write_trajectories
from components.envs.base import Environment, Task, ToolLatency


def _tir_math(cfg: Config, n: int, tasks_uri: str | None) -> tuple[Environment, list[Task]]:
    from components.data.tasks import generate_problems
    from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems

    env = TIRMathEnvironment(cfg.rollout.tool_timeout_s, _latency(cfg))
    if tasks_uri:
        from components.data.problem_sets import load_tasks

        return env, load_tasks(tasks_uri, limit=n)
    return env, tasks_from_problems(generate_problems(cfg.task.kinds, n, cfg.task.seed + 1, cfg.task.operand_max,
                                                      "train"))


def _coding(cfg: Config, n: int, tasks_uri: str | None) -> tuple[Environment, list[Task]]:
    from components.envs.coding import CodingEnvironment, load_coding_tasks

    tasks = load_coding_tasks(tasks_uri)
    return CodingEnvironment(tasks, latency=_latency(cfg), timeout_s=cfg.rollout.tool_timeout_s), _cycle(tasks, n)


def _style(cfg: Config, n: int, tasks_uri: str | None) -> tuple[Environment, list[Task]]:
    from components.envs.style import LexicalJudge, StyleEnvironment, load_style_tasks

    tasks = load_style_tasks(tasks_uri)
    return StyleEnvironment(tasks, LexicalJudge()), _cycle(tasks, n)


ENVIRONMENTS: dict[str, Callable[[Config, int, str | None], tuple[Environment, list[Task]]]] = {
    "tir_math": _tir_math,
    "coding": _coding,
    "style": _style,
}


def run_rollout(cfg: Config, model_dir: Path, env_name: str, episodes: int, out: Path,
                tasks_uri: str | None = None, log=print) -> list[Trajectory]:
    from components.models import load_policy, load_tokenizer, stop_token_ids
    from components.rollout.embedded import EmbeddedEngine

    if env_name not in ENVIRONMENTS:
        raise ValueError(f"env: unknown environment {env_name!r}; known: {sorted(ENVIRONMENTS)}")
    env, tasks = ENVIRONMENTS[env_name](cfg, episodes, tasks_uri)
    tokenizer = load_tokenizer(model_dir)
    engine = EmbeddedEngine(load_policy(model_dir), tokenizer, max_batch=cfg.rollout.max_batch).start()
    limits = EpisodeLimits(cfg.task.max_turns, cfg.task.max_new_tokens, cfg.rollout.max_total_tokens,
                           cfg.rollout.max_wall_s, cfg.algo.temperature)
    runner = AgentRunner(engine, tokenizer, env, limits, cfg.rollout.concurrency,
                         tuple(stop_token_ids(tokenizer)), seed=cfg.task.seed)
    start = time.perf_counter()
    try:
        trajectories = asyncio.run(runner.run(tasks))
    finally:
        engine.shutdown()
    elapsed = time.perf_counter() - start
    write_trajectories(out, trajectories)
    n = len(trajectories)
    actions = sum(t.num_actions for t in trajectories)
    log(f"rollout: {n} {env_name} episodes in {elapsed:.1f}s ({n / elapsed:.1f} episodes/s, "
        f"{actions / elapsed:,.0f} action tok/s, concurrency {cfg.rollout.concurrency})")
    log(f"  reward mean {sum(t.reward for t in trajectories) / n:.3f}, turns mean "
        f"{sum(t.turns for t in trajectories) / n:.2f}, finish {dict(Counter(t.finish_reason for t in trajectories))}")
    log(f"  wrote {out}")
    return trajectories


def _latency(cfg: Config) -> ToolLatency:
    return ToolLatency(cfg.rollout.latency, cfg.rollout.latency_mean_s, cfg.rollout.latency_sigma, cfg.task.seed)


def _cycle(tasks: list[Task], n: int) -> list[Task]:
    """n episodes over a small task set: repeat it, with distinct episode ids."""
    return [Task(f"{t.task_id}#{i // len(tasks)}", t.prompt, t.answer, t.metadata)
            for i, t in zip(range(n), tasks * (n // len(tasks) + 1))]

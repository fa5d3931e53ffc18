"""`sao rollout`: run episodes of one environment with the SFT policy on the embedded engine, write Parquet.

`sample_episodes` is the shared part: episodes of a policy directory on the embedded engine with the config's
limits. Value pretraining (components/training/value_pretrain.py) collects its rollouts with it too.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from pathlib import Path

from components.agent.runner import AgentRunner, episode_limits
from components.config import Config
from components.contracts.environment import Environment
from components.contracts.task import Task
from components.contracts.trajectory import Trajectory, write_trajectories
from components.envs.registry import build_env
from components.models import load_chat, load_policy
from components.rollout.embedded import EmbeddedEngine


def sample_episodes(
    cfg: Config, model_dir: Path, env: Environment, tasks: list[Task], seed: int, concurrency: int
) -> tuple[list[Trajectory], float]:
    """One episode per task in `env`, sampled from the policy at `model_dir` on the embedded engine with the
    config's episode limits and temperature, `concurrency` episodes in flight; `seed` seeds the per-request
    sampling (each request's seed depends on it, the task id and the turn, never on the concurrency).
    Returns (trajectories in finish order, seconds)."""
    chat = load_chat(model_dir, cfg.model.chat_format)
    engine = EmbeddedEngine(load_policy(model_dir), chat.tokenizer, max_batch=cfg.rollout.max_batch).start()
    runner = AgentRunner(engine, chat, env, episode_limits(cfg), concurrency, seed=seed)
    start = time.perf_counter()
    try:
        trajectories = asyncio.run(runner.run(tasks))
    finally:
        engine.shutdown()
    return trajectories, time.perf_counter() - start


def run_rollout(cfg: Config, model_dir: Path, episodes: int, out: Path, log=print) -> list[Trajectory]:
    """`episodes` episodes of `cfg.env`'s training stream from its start (`sao rollout --env/--tasks` set
    `env.name` and `env.tasks`)."""
    setup = build_env(cfg, log)
    tasks = list(itertools.islice(setup.train_tasks(0, 1), episodes))
    trajectories, elapsed = sample_episodes(cfg, model_dir, setup.env, tasks, cfg.task.seed, cfg.rollout.concurrency)
    write_trajectories(out, trajectories)
    n = len(trajectories)
    actions = sum(t.num_actions for t in trajectories)
    log(
        f"rollout: {n} {setup.name} episodes in {elapsed:.1f}s ({n / elapsed:.1f} episodes/s, "
        f"{actions / elapsed:,.0f} action tok/s, concurrency {cfg.rollout.concurrency})"
    )
    log(
        f"  reward mean {sum(t.reward for t in trajectories) / n:.3f}, turns mean "
        f"{sum(t.turns for t in trajectories) / n:.2f}, finish {dict(Counter(t.finish_reason for t in trajectories))}"
    )
    log(f"  wrote {out}")
    return trajectories

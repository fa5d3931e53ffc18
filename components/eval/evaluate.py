"""Evaluation on the one episode path: `AgentRunner` + an engine + the environment, exactly as in training.

Greedy evaluation is the engine at temperature 0, with the tool calls in the same sandbox and limits as
rollouts. Every task gets one greedy episode; with `samples = K > 1` it also gets K sampled episodes at the
rollout temperature. From those trajectories:

    accuracy = (1 / N) sum_i  success(greedy_i)                       greedy held-out accuracy
    avg@K    = (1 / N) sum_i  (1 / K) sum_k success(sample_ik)         expected success of one sample
    pass@K   = (1 / N) sum_i  max_k success(sample_ik)                 solved by at least one of K samples

where success means the episode's reward reached the environment's `success_threshold` (1.0 for exact
answers and for all hidden tests passed). With K = 1 the "samples" are the greedy episodes themselves, so
avg@1 = pass@1 = accuracy. pass@K here is the plain empirical estimate from exactly K samples (with n = K
the unbiased estimator of Chen et al. 2021 reduces to it).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from components.agent.runner import AgentRunner, EpisodeLimits
from components.chat import ChatFormat
from components.contracts.environment import Environment
from components.contracts.task import Task
from components.contracts.trajectory import Trajectory


@dataclass
class EvalReport:
    env: str
    """Environment name."""
    n: int
    """Tasks evaluated."""
    samples: int
    """K: sampled episodes per task (1: the greedy episode only)."""
    accuracy: float
    """Fraction of tasks whose greedy episode succeeded."""
    avg_at_k: float
    """Mean over tasks of the fraction of its K episodes that succeeded."""
    pass_at_k: float
    """Fraction of tasks with at least one successful episode among K."""
    reward_mean: float
    """Mean reward of the greedy episodes."""
    tool_calls_mean: float
    """Tool calls per greedy episode."""
    finish_reasons: dict[str, int]
    """Count per finish reason over the greedy episodes."""
    seconds: float
    """Wall time of all episodes."""
    greedy: list[Trajectory] = field(default_factory=list, repr=False)
    """One greedy trajectory per task, in task order."""
    sampled: list[list[Trajectory]] = field(default_factory=list, repr=False)
    """K trajectories per task, in task order (the greedy ones when K = 1)."""

    def summary(self) -> dict:
        """The report's numbers (no trajectories), for JSON and metrics."""
        return {
            "env": self.env,
            "n": self.n,
            "samples": self.samples,
            "accuracy": self.accuracy,
            f"avg@{self.samples}": self.avg_at_k,
            f"pass@{self.samples}": self.pass_at_k,
            "reward_mean": self.reward_mean,
            "tool_calls_mean": self.tool_calls_mean,
            "finish_reasons": self.finish_reasons,
            "seconds": self.seconds,
        }


def score(greedy: list[Trajectory], sampled: list[list[Trajectory]], threshold: float) -> tuple[float, float, float]:
    """(accuracy, avg@K, pass@K) of per-task trajectories, as defined in the module docstring."""
    if not greedy or len(greedy) != len(sampled):
        raise ValueError(
            f"score: need one greedy trajectory and K samples per task, got {len(greedy)} and {len(sampled)} tasks"
        )
    k = len(sampled[0])
    if k < 1 or any(len(s) != k for s in sampled):
        raise ValueError(f"score: every task needs the same number K >= 1 of samples, got {[len(s) for s in sampled]}")

    def ok(t: Trajectory) -> bool:
        return t.reward >= threshold

    n = len(greedy)
    accuracy = sum(ok(t) for t in greedy) / n
    avg = sum(sum(ok(t) for t in s) / k for s in sampled) / n
    passed = sum(any(ok(t) for t in s) for s in sampled) / n
    return accuracy, avg, passed


def evaluate(
    engine,
    chat: ChatFormat,
    env: Environment,
    tasks: list[Task],
    limits: EpisodeLimits,
    samples: int = 1,
    concurrency: int = 64,
    seed: int = 0,
) -> EvalReport:
    """Greedy episodes of every task, plus `samples` sampled ones at `limits.temperature` when samples > 1."""
    if not tasks:
        raise ValueError("tasks: nothing to evaluate")
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"tasks: task ids must be unique ({len(ids) - len(set(ids))} duplicates)")
    start = time.perf_counter()

    def run(batch: list[Task], temperature: float) -> dict[str, Trajectory]:
        runner = AgentRunner(engine, chat, env, replace(limits, temperature=temperature), concurrency, seed=seed)
        return {t.prompt_id: t for t in asyncio.run(runner.run(batch))}

    greedy_by_id = run(tasks, 0.0)
    greedy = [greedy_by_id[t.task_id] for t in tasks]
    if samples == 1:
        sampled = [[t] for t in greedy]
    else:
        copies = [replace(t, task_id=f"{t.task_id}#s{k}") for t in tasks for k in range(samples)]
        by_id = run(copies, limits.temperature)
        sampled = [[by_id[f"{t.task_id}#s{k}"] for k in range(samples)] for t in tasks]
    accuracy, avg, passed = score(greedy, sampled, getattr(env, "success_threshold", 1.0))
    return EvalReport(
        env=env.name,
        n=len(tasks),
        samples=samples,
        accuracy=accuracy,
        avg_at_k=avg,
        pass_at_k=passed,
        reward_mean=sum(t.reward for t in greedy) / len(greedy),
        tool_calls_mean=sum(t.metadata.get("tool_calls", 0) for t in greedy) / len(greedy),
        finish_reasons=dict(Counter(t.finish_reason for t in greedy)),
        seconds=time.perf_counter() - start,
        greedy=greedy,
        sampled=sampled,
    )

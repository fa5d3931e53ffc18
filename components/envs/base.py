"""The environment protocol the agent runner drives (DESIGN section 3: prompt -> [generate <-> env.step]*).

An `Environment` is created once per run from a task list; `start(task)` opens one `EnvEpisode`. An
episode turns each model turn (the decoded text of one generation, ending with a stop marker or cut off) into
either an observation the model sees next (a tool result) or the end of the episode with its reward.
Episodes keep their own state, so many run concurrently.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from components.contracts.task import Task


@dataclass(frozen=True)
class StepResult:
    observation: str | None
    """Text appended as observation tokens (action_mask 0), or None when the episode ends."""
    done: bool
    """The episode is over."""
    reward: float = 0.0
    """Outcome reward (meaningful when done); it lands on the last action token."""
    finish_reason: str | None = None
    """Why it ended when done: `stop` (answered), `tool_error`, ... (see `Trajectory.finish_reason`)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Environment details for the trajectory's metadata (grading, test counts, ...)."""


class EnvEpisode(Protocol):
    def prompt_text(self) -> str:
        """The full prompt (chat markers included) the first model turn continues."""

    async def step(self, turn_text: str, truncated: bool) -> StepResult:
        """React to one model turn; `truncated` is True when the turn hit its token limit."""


class Environment(Protocol):
    name: str
    success_threshold: float
    """An episode whose reward reaches this counts as solved (evaluation's accuracy, avg@k and pass@k)."""

    def start(self, task: Task) -> EnvEpisode:
        """A fresh episode for `task`."""


@dataclass(frozen=True)
class ToolLatency:
    """Simulated tool latency so benchmarks reproduce uneven trajectories (DESIGN: heavy-tailed tool calls).

    `none`: 0. `fixed`: always `mean_s`. `lognormal`: median `mean_s * exp(-sigma^2 / 2)`, mean `mean_s`,
    heavy right tail for large sigma (sigma = 1.5 puts the 99th percentile at ~10x the mean).
    """

    kind: Literal["none", "fixed", "lognormal"] = "none"
    mean_s: float = 0.0
    sigma: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "fixed", "lognormal"):
            raise ValueError(f"latency.kind: must be none, fixed or lognormal, got {self.kind!r}")
        if self.mean_s < 0 or self.sigma < 0:
            raise ValueError("latency.mean_s and latency.sigma must be >= 0")

    def sampler(self, key: str) -> "random.Random":
        """A per-episode generator, so delays do not depend on which episode happens to run first."""
        return random.Random(f"{self.seed}:{key}")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "none" or self.mean_s == 0:
            return 0.0
        if self.kind == "fixed":
            return self.mean_s
        mu = math.log(self.mean_s) - self.sigma**2 / 2
        return rng.lognormvariate(mu, self.sigma)

    async def wait(self, rng: random.Random) -> float:
        delay = self.sample(rng)
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

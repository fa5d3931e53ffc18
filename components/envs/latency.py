"""Simulated tool latency, so benchmarks and tests reproduce uneven, heavy-tailed trajectories."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import get_args

from components.config import LatencyKind


@dataclass(frozen=True)
class ToolLatency:
    """Simulated tool latency so benchmarks reproduce uneven trajectories (heavy-tailed tool calls).

    `none`: 0. `fixed`: always `mean_s`. `lognormal`: median `mean_s * exp(-sigma^2 / 2)`, mean `mean_s`,
    heavy right tail for large sigma (sigma = 1.5 puts the 99th percentile at ~10x the mean).
    """

    kind: LatencyKind = "none"
    mean_s: float = 0.0
    sigma: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in get_args(LatencyKind):
            raise ValueError(f"latency.kind: must be one of {get_args(LatencyKind)}, got {self.kind!r}")
        if self.mean_s < 0 or self.sigma < 0:
            raise ValueError("latency.mean_s and latency.sigma must be >= 0")

    def sampler(self, key: str) -> random.Random:
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


NO_LATENCY = ToolLatency()
"""Tools answer as fast as they run (the default everywhere but benchmarks)."""

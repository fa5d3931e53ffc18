"""Trajectory buffer with staleness admission control (docs/design.md section 3).

Staleness is bounded by admission, never by dropping finished work: finished trajectories are always kept
(dropping stale ones biases training toward short, fast rollouts). Two admission rules:

- `capacity` (default, AReaL's StalenessManager): episode number n (in start order) may start only once
  the trainer reaches version `n // batch_size - max_staleness`, i.e. at most
  `(version + max_staleness + 1) * batch_size` episodes have ever started. Were batches consumed in start
  order, nothing would be trained more than `max_staleness` versions late. Stragglers (an episode stuck
  behind a slow tool) finish late and are trained late, at a staleness above the bound, which
  `rollout/staleness_max` reports and DIS's trust window masks; the rest of the pipeline never waits for them.
- `oldest`: a new episode starts only while the trainer is at most `max_staleness` versions ahead of the
  oldest in-flight episode's start version. Stricter, but one straggler stalls every new start: with
  heavy-tailed tool latency it left the trainer idle 55% of the time, against 8% (`make bench BENCH=async`).

In grouped mode (GRPO) trajectories are released only as whole groups of `group_size`: the barrier that
SAO removes.

`max_token_lag` (`train.max_token_lag`, off by default) is the one exception to keeping finished work, as an
option: a trajectory whose oldest sampled token is more than that many versions behind the version being trained
when a batch is taken is evicted (unirl's rule), its admission slot given back so another episode starts, and
counted in `evicted` (`rollout/evicted`). `drop_uniform_groups` (`train.group_filter = "drop-uniform"`) drops a
finished group whose rewards are all equal (GRPO's advantages are 0 for it) and gives its slots back, counted in
`groups_dropped` (`rollout/groups_dropped`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import get_args

from components.config import AdmissionRule
from components.contracts.task import Task
from components.contracts.trajectory import Trajectory

ADMISSION_RULES: tuple[str, ...] = get_args(AdmissionRule)


class TrajectoryBuffer:
    def __init__(
        self,
        max_staleness: int,
        batch_size: int = 1,
        group_size: int = 1,
        rule: AdmissionRule = "capacity",
        version: int = 0,
        max_token_lag: int | None = None,
        drop_uniform_groups: bool = False,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if rule not in ADMISSION_RULES:
            raise ValueError(f"rule: must be one of {ADMISSION_RULES}, got {rule!r}")
        if max_token_lag is not None and (max_token_lag < 0 or group_size != 1):
            raise ValueError(f"max_token_lag: must be >= 0 and single rollouts (group_size 1), got {max_token_lag}")
        self.max_token_lag = max_token_lag
        self.evicted = 0
        self.drop_uniform_groups, self.groups_dropped = drop_uniform_groups, 0
        self.max_staleness, self.batch_size, self.group_size, self.rule = max_staleness, batch_size, group_size, rule
        self.version = version
        self.started = version * batch_size  # a resumed run has trained on exactly this many
        self._start_versions: dict[str, int] = {}
        self._ready: list[Trajectory] = []
        self._groups: dict[str, list[Trajectory]] = {}
        self._cond = asyncio.Condition()
        self.admission_waits = 0
        self.discarded = 0
        self.closed = False

    def _oldest_start(self) -> int | None:
        return min(self._start_versions.values()) if self._start_versions else None

    def admissible(self) -> bool:
        if self.closed:
            return True
        if self.rule == "capacity":
            return self.started < (self.version + self.max_staleness + 1) * self.batch_size
        oldest = self._oldest_start()
        return oldest is None or self.version - oldest <= self.max_staleness

    async def admit(self, task: Task) -> None:
        """Wait until a new episode may start, then record its start version."""
        async with self._cond:
            if not self.admissible():
                self.admission_waits += 1
                await self._cond.wait_for(self.admissible)
            self._start_versions[task.task_id] = self.version
            self.started += 1

    async def put(self, trajectory: Trajectory) -> None:
        async with self._cond:
            self._start_versions.pop(trajectory.prompt_id, None)
            if self.group_size == 1:
                self._ready.append(trajectory)
            else:
                group = self._groups.setdefault(group_key(trajectory.prompt_id), [])
                group.append(trajectory)
                if len(group) == self.group_size:
                    members = self._groups.pop(group_key(trajectory.prompt_id))
                    if self.drop_uniform_groups and len({t.reward for t in members}) == 1:
                        self.started -= self.group_size  # no signal: its slots go to other prompts
                        self.groups_dropped += 1
                    else:
                        self._ready.extend(members)
            self._cond.notify_all()

    async def discard(self, trajectory: Trajectory) -> None:
        """An episode that yields nothing to train on (every engine failed it): its start is given back, so
        admission control counts only episodes that will arrive. Single-rollout mode only: a group needs
        all its members."""
        if self.group_size != 1:
            raise ValueError("discard: grouped batches need every member of a group; put it instead")
        async with self._cond:
            self._start_versions.pop(trajectory.prompt_id, None)
            self.started -= 1
            self.discarded += 1
            self._cond.notify_all()

    async def take(self, n: int) -> list[Trajectory]:
        """The next `n` finished trajectories in arrival order (whole groups in grouped mode), those `max_token_lag`
        evicts left out."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._evict() >= n)
            batch, self._ready = self._ready[:n], self._ready[n:]
            return batch

    def _evict(self) -> int:
        """Evict the waiting trajectories whose oldest token is more than `max_token_lag` versions behind (the lock
        held); returns how many wait."""
        if self.max_token_lag is not None:
            floor = self.version - self.max_token_lag
            kept = [t for t in self._ready if oldest_version(t, self.version) >= floor]
            gone = len(self._ready) - len(kept)
            if gone:
                self._ready, self.started, self.evicted = kept, self.started - gone, self.evicted + gone
                self._cond.notify_all()  # their slots are free: admission may start others
        return len(self._ready)

    async def set_version(self, version: int) -> None:
        async with self._cond:
            self.version = version
            self._cond.notify_all()

    async def close(self) -> None:
        """Release anyone waiting for admission (the run is ending; the runner's stop flag stops it)."""
        async with self._cond:
            self.closed = True
            self._cond.notify_all()

    @property
    def ready(self) -> int:
        """Finished trajectories waiting to be taken."""
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        return len(self._start_versions)

    def start_version_counts(self) -> Counter:
        return Counter(self._start_versions.values())


def oldest_version(trajectory: Trajectory, default: int) -> int:
    """The version that sampled the trajectory's oldest token (`default` when it sampled none)."""
    return min((v for v in trajectory.versions if v is not None), default=default)


def group_key(task_id: str) -> str:
    """Episodes of one GRPO group share the id before `#g`."""
    return task_id.split("#g", 1)[0]


class BatchesExhausted(Exception):
    """A batch source has no more batches (a replay's recording ended): the loop ends there."""

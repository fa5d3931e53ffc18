"""What counts as a collapse, in one place (stability issue, docs/stability.md).

Online, during training: the smoothed reward (mean `reward/mean` over the last `window` steps) stays below
`drop` x its running peak for `patience` consecutive steps. The trainer's guard acts on it (roll back or
stop) and the sweep reports it. Offline, after training: held-out greedy accuracy below the starting
(SFT) policy's. The sweep calls a run collapsed when either fired.

The smoothing matters: a batch of 16 one-shot rewards is noisy (one batch of a policy at 0.85 falls below
0.43 with probability ~1e-5, ten smoothed steps in a row essentially never), while a real collapse drives
the reward to 0 and keeps it there.

Where the guard returns to (`train.rollback_to`): the rule fires at half the peak, so for a slow drift the step before
the collapse's onset is already far below the peak (a paper-setting run, docs/stability.md: rolled back to a policy
at a smoothed 0.33 of a 0.62 peak, and never recovered). `near-peak` returns to before the smoothed reward last left
`NEAR_PEAK` x its peak instead; for a sudden collapse the two are a few steps apart.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from components.config import RollbackTo

NEAR_PEAK = 0.9
"""A smoothed reward at or above this fraction of its running peak is near the peak (`near-peak` rollbacks)."""


@dataclass(frozen=True)
class Collapse:
    step: int
    """Step at which the detector fired."""
    onset: int
    """First step of the streak below the threshold."""
    cause: str
    """Human-readable reason, with the numbers."""
    decline: int | None = None
    """First step of the window in which the smoothed reward last fell below `NEAR_PEAK` x its peak on its way
    down (at or before `onset`; None: not tracked)."""

    @property
    def last_good_step(self) -> int:
        """Newest step trusted to predate the collapse: the smoothed value at the onset already averages
        `window` steps, so the decline may have begun that much earlier."""
        return self.onset - 1

    def good_step(self, to: RollbackTo) -> int:
        """The newest step a rollback may return to: before the onset, or (`near-peak`) before the decline."""
        if to == "onset" or self.decline is None:
            return self.last_good_step
        return min(self.last_good_step, self.decline - 1)


@dataclass
class CollapseDetector:
    window: int = 10
    """Steps in the moving average of `reward/mean`."""
    drop: float = 0.5
    """Fires when the smoothed reward is below this fraction of its running peak ..."""
    patience: int = 10
    """... for this many consecutive steps."""
    _recent: collections.deque = field(default_factory=collections.deque, repr=False)
    _peak: float = float("-inf")
    _streak_start: int | None = None
    _below_near: int | None = None
    """The step the smoothed reward last fell below `NEAR_PEAK` x its peak (None while it is near it)."""
    _hold: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 1 or not 0 < self.drop < 1:
            raise ValueError(
                f"collapse detector: window and patience >= 1 and drop in (0, 1), got "
                f"{self.window}, {self.patience}, {self.drop}"
            )

    def update(self, step: int, reward: float) -> Collapse | None:
        """Feed one step's `reward/mean`; returns a `Collapse` when the rule fires (once per streak)."""
        if self._hold > 0:  # see `reset`
            self._hold -= 1
            return None
        self._recent.append(reward)
        if len(self._recent) > self.window:
            self._recent.popleft()
        if len(self._recent) < self.window:
            return None
        smoothed = sum(self._recent) / self.window
        healthy = smoothed >= self.drop * self._peak
        if healthy:
            self._peak = max(self._peak, smoothed)
            self._streak_start = None
        if smoothed >= NEAR_PEAK * self._peak:
            self._below_near = None
        elif self._below_near is None:
            self._below_near = step
        if healthy:
            return None
        if self._streak_start is None:
            self._streak_start = step
        if step - self._streak_start + 1 == self.patience:
            return Collapse(
                step,
                self._streak_start - self.window + 1,
                f"reward/mean over {self.window} steps at {smoothed:.3f}, below {self.drop:g} x its "
                f"peak {self._peak:.3f} for {self.patience} steps",
                decline=None if self._below_near is None else self._below_near - self.window + 1,
            )
        return None

    def reset(self, hold: int = 0) -> None:
        """Forget the history (after a rollback the reward curve starts again from the restored policy), and
        ignore the next `hold` steps: after the task changed (a preference flip), batches still hold episodes
        started under the old task for up to max_staleness + 1 steps, and their reward would set a peak the
        new task's curve is then measured against."""
        if hold < 0:
            raise ValueError(f"hold: must be >= 0, got {hold}")
        self._recent.clear()
        self._peak, self._streak_start, self._below_near, self._hold = float("-inf"), None, None, hold


def collapsed_on_eval(accuracy: float, start_accuracy: float) -> bool:
    """Offline rule: held-out accuracy after training below the starting policy's."""
    return accuracy < start_accuracy

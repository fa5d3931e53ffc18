"""What counts as a collapse, in one place (stability issue, docs/stability.md).

Online, during training: the smoothed reward (mean `reward/mean` over the last `window` steps) stays below
`drop` x its running peak for `patience` consecutive steps. The trainer's guard acts on it (roll back or
stop) and the sweep reports it. Offline, after training: held-out greedy accuracy below the starting
(SFT) policy's. The sweep calls a run collapsed when either fired.

The smoothing matters: a batch of 16 one-shot rewards is noisy (one batch of a policy at 0.85 falls below
0.43 with probability ~1e-5, ten smoothed steps in a row essentially never), while a real collapse drives
the reward to 0 and keeps it there.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Collapse:
    step: int
    """Step at which the detector fired."""
    onset: int
    """First step of the streak below the threshold."""
    cause: str
    """Human-readable reason, with the numbers."""

    @property
    def last_good_step(self) -> int:
        """Newest step trusted to predate the collapse: the smoothed value at the onset already averages
        `window` steps, so the decline may have begun that much earlier."""
        return self.onset - 1


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
        if smoothed >= self.drop * self._peak:
            self._peak = max(self._peak, smoothed)
            self._streak_start = None
            return None
        if self._streak_start is None:
            self._streak_start = step
        if step - self._streak_start + 1 == self.patience:
            return Collapse(
                step,
                self._streak_start - self.window + 1,
                f"reward/mean over {self.window} steps at {smoothed:.3f}, below {self.drop:g} x its "
                f"peak {self._peak:.3f} for {self.patience} steps",
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
        self._peak, self._streak_start, self._hold = float("-inf"), None, hold


def collapsed_on_eval(accuracy: float, start_accuracy: float) -> bool:
    """Offline rule: held-out accuracy after training below the starting policy's."""
    return accuracy < start_accuracy

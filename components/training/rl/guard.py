"""The collapse guard: what the trainer does when the collapse rule fires (docs/stability.md).

The rule itself is `CollapseDetector` (components/training/rl/stability.py). With `train.collapse_guard`:

- `rollback`: load the newest checkpoint from before the collapse's onset, or with `train.rollback_to =
  "near-peak"` from before the smoothed reward last left 0.9 x its peak (never one from before the current
  task's start, `floor`), scale both learning rates by `train.rollback_lr_scale`, go on; after more than
  `train.max_rollbacks` rollbacks the run ends at the restored weights;
- `stop`: restore the same checkpoint and end the run;
- `off`: log the collapse and go on (the soak and the claims experiments watch the method without it).

Its record (rollbacks so far, the learning-rate factor) travels in every checkpoint, so a resumed run continues
with the same budget and factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from components.config import RollbackTo, TrainConfig
from components.training.rl.stability import Collapse, CollapseDetector

if TYPE_CHECKING:
    from components.training.rl.checkpoint import CheckpointStore
    from components.training.rl.learner import Learner

Log = Callable[[str], None]


class CollapseGuard:
    def __init__(
        self,
        mode: str,
        max_rollbacks: int,
        rollback_lr_scale: float,
        detector: CollapseDetector | None = None,
        rollback_to: RollbackTo = "onset",
    ) -> None:
        self.mode, self.max_rollbacks, self.rollback_lr_scale = mode, max_rollbacks, rollback_lr_scale
        self.rollback_to: RollbackTo = rollback_to
        self.detector = detector or CollapseDetector()
        """The collapse rule (tests pass a hair-trigger one)."""
        self.rollbacks = 0
        """Rollbacks over the whole run, resumes included."""
        self.lr_scale = 1.0
        """Factor on both learning rates, `rollback_lr_scale` per rollback."""
        self.floor = 0
        """The current task's first step: the guard never returns to weights trained for an earlier task."""

    @classmethod
    def from_config(cls, tc: TrainConfig, detector: CollapseDetector | None = None) -> CollapseGuard:
        return cls(tc.collapse_guard, tc.max_rollbacks, tc.rollback_lr_scale, detector, tc.rollback_to)

    @property
    def active(self) -> bool:
        """Whether a collapse changes the run (`rollback` or `stop`); the guard then needs checkpoints."""
        return self.mode != "off"

    @property
    def ends(self) -> bool:
        """After a rollback: does the run end there (`stop`, or more rollbacks than `max_rollbacks`)?"""
        return self.mode == "stop" or self.rollbacks > self.max_rollbacks

    def state(self) -> dict:
        """The record a checkpoint carries."""
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale}

    def load(self, state: dict) -> None:
        self.rollbacks = state.get("rollbacks", self.rollbacks)
        self.lr_scale = state.get("lr_scale", self.lr_scale)

    def task_changed(self, step: int, hold: int) -> None:
        """The task changed before step `step` (a preference flip): the reward drops on purpose, so the rule
        starts over and skips the next `hold` batches (they still hold episodes of the old task); rollbacks stay
        within the new task from now on."""
        self.detector.reset(hold=hold)
        if self.active:
            self.floor = step

    def check(self, step: int, reward: float) -> Collapse | None:
        """Feed step `step`'s `reward/mean`; a `Collapse` when the rule fires."""
        return self.detector.update(step, reward)

    def roll_back(self, collapse: Collapse, store: CheckpointStore, learner: Learner, log: Log) -> int | None:
        """Load the newest checkpoint from before the collapse's onset (or its decline, `rollback_to`), and not
        before `floor`, into the learner and update the record. Returns the restored step, or None when there is
        none to return to."""
        good = collapse.good_step(self.rollback_to)
        found = store.load_latest(log, at_most=good, read=learner.load, at_least=self.floor)
        if found is None:
            log(
                f"train: collapse at step {collapse.step} ({collapse.cause}) and no checkpoint between steps "
                f"{self.floor} and {good + 1} to roll back to; stopping"
            )
            return None
        restored, _ = found
        self.rollbacks += 1
        if not self.ends:
            self.lr_scale *= self.rollback_lr_scale
        log(
            f"train: collapse at step {collapse.step} ({collapse.cause}); "
            + ("rolling back and stopping" if self.ends else f"rolling back, learning rates now x{self.lr_scale:g}")
        )
        self.detector.reset()  # the reward curve starts again from the restored policy
        return restored

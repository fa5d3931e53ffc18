"""The collapse guard (components/training/rl/guard.py) on a real learner and a real checkpoint store: which
checkpoint it returns to, the learning-rate factor, when the run ends, the task floor and its record."""

from dataclasses import replace

import pytest
import torch

from components.training.rl.algorithms import settings_from
from components.training.rl.checkpoint import LocalCheckpointStore
from components.training.rl.guard import CollapseGuard
from components.training.rl.learner import Learner
from components.training.rl.stability import Collapse, CollapseDetector


@pytest.fixture
def learner(tiny_cfg, sft_dir):
    cfg = replace(tiny_cfg, train=replace(tiny_cfg.train, backend="torch", threads=1))
    return Learner(cfg, sft_dir, settings_from(cfg), threads=1)


def _first_weight(learner) -> torch.Tensor:
    return next(learner.policy.module.parameters()).detach().clone()


@pytest.fixture
def store(tmp_path, learner):
    """Checkpoints at steps 0, 10 and 20, the policy's first weight set to 0, 10 and 20 in each."""
    store = LocalCheckpointStore(tmp_path / "checkpoints")
    for step in (0, 10, 20):
        with torch.no_grad():
            next(learner.policy.module.parameters()).fill_(float(step))
        store.save(step, {}, write=learner.save)
    return store


def test_a_rollback_returns_to_the_newest_checkpoint_before_the_onset(learner, store):
    # Onset 15: the smoothed reward there already averages earlier steps, so the last good step is 14 and the
    # newest checkpoint at or before it is step 10 (not 20).
    guard = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5)
    log = []
    assert guard.roll_back(Collapse(step=24, onset=15, cause="test"), store, learner, log.append) == 10
    assert torch.all(_first_weight(learner) == 10.0)
    assert (guard.rollbacks, guard.lr_scale, guard.ends) == (1, 0.5, False)
    assert "learning rates now x0.5" in log[-1]
    # A second collapse halves again: 0.25.
    assert guard.roll_back(Collapse(step=30, onset=25, cause="test"), store, learner, log.append) == 20
    assert (guard.rollbacks, guard.lr_scale) == (2, 0.25)


def test_a_near_peak_rollback_returns_to_before_the_decline(learner, store):
    # Onset 15 (last good step 14: checkpoint 10), but the smoothed reward left 0.9 x its peak in the window that
    # starts at step 8: near-peak returns to the newest checkpoint at or before step 7, step 0.
    drift = Collapse(step=24, onset=15, cause="test", decline=8)
    near = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5, rollback_to="near-peak")
    assert near.roll_back(drift, store, learner, lambda _: None) == 0
    assert torch.all(_first_weight(learner) == 0.0)
    onset = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5)
    assert onset.roll_back(drift, store, learner, lambda _: None) == 10
    # A collapse without a tracked decline (decline None) goes back to before its onset either way.
    assert near.roll_back(Collapse(step=24, onset=15, cause="test"), store, learner, lambda _: None) == 10
    # Nothing at or before the decline within the task: the run stops, naming where it looked.
    near.task_changed(5, hold=0)
    log = []
    assert near.roll_back(drift, store, learner, log.append) is None
    assert "no checkpoint between steps 5 and 8" in log[-1]


def test_the_guard_ends_the_run_after_its_last_allowed_rollback_or_in_stop_mode(learner, store):
    collapse = Collapse(step=24, onset=15, cause="test")
    limited = CollapseGuard("rollback", max_rollbacks=1, rollback_lr_scale=0.5)
    limited.roll_back(collapse, store, learner, lambda _: None)
    assert not limited.ends
    limited.roll_back(collapse, store, learner, lambda _: None)
    assert limited.ends and limited.lr_scale == 0.5  # the run ends at the restored weights: no new factor
    stop = CollapseGuard("stop", max_rollbacks=5, rollback_lr_scale=0.5)
    assert stop.roll_back(collapse, store, learner, lambda _: None) == 10
    assert stop.ends and stop.lr_scale == 1.0


def test_the_guard_never_returns_to_an_earlier_task(learner, store):
    guard = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5)
    guard.task_changed(12, hold=3)  # a preference flip before step 12: checkpoint 10 belongs to the old task
    log = []
    assert guard.roll_back(Collapse(step=24, onset=15, cause="test"), store, learner, log.append) is None
    assert guard.rollbacks == 0 and "no checkpoint between steps 12 and 15" in log[-1]
    off = CollapseGuard("off", max_rollbacks=3, rollback_lr_scale=0.5)
    off.task_changed(12, hold=3)
    assert off.floor == 0 and not off.active  # off: the floor never matters, and is not moved


def test_a_task_change_holds_the_rule_off_and_the_record_survives_a_checkpoint():
    detector = CollapseDetector(window=1, drop=0.5, patience=1)
    guard = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5, detector=detector)
    assert guard.check(1, 1.0) is None and guard.check(2, 0.1) is not None  # fires at once: 0.1 < 0.5 x 1.0
    guard.task_changed(3, hold=2)
    # Held for 2 steps (old-task batches), then the peak starts again from the new task's level.
    assert [guard.check(s, r) for s, r in ((3, 1.0), (4, 1.0), (5, 0.1), (6, 0.1))] == [None] * 4
    guard.rollbacks, guard.lr_scale = 2, 0.25
    resumed = CollapseGuard("rollback", max_rollbacks=3, rollback_lr_scale=0.5)
    resumed.load(guard.state())
    assert (resumed.rollbacks, resumed.lr_scale) == (2, 0.25)

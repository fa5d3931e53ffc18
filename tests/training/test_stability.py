"""The collapse rule (components/training/rl/stability.py) and its replay over a logged run (components/stages/sweep.py)."""

import math

import pytest

from components.stages.sweep import replay_collapses, summarize
from components.training.rl.stability import CollapseDetector, collapsed_on_eval


def _feed(detector, rewards, start=1):
    return [(step, c) for step, r in enumerate(rewards, start) if (c := detector.update(step, r)) is not None]


def test_detector_fires_after_patience_steps_below_half_the_smoothed_peak():
    # window 2, patience 3. Rewards 1,1 -> smoothed peak 1.0 at step 2. Then 0s: step 3 smoothed 0.5 (not
    # below 0.5 x 1.0), step 4 smoothed 0.0 (streak starts), steps 5 and 6 stay 0: fires at 6 (4, 5, 6).
    detector = CollapseDetector(window=2, drop=0.5, patience=3)
    fired = _feed(detector, [1, 1, 0, 0, 0, 0, 0, 0])
    assert [step for step, _ in fired] == [6]  # once per streak
    collapse = fired[0][1]
    # The streak's first smoothed value (step 4) averages steps 3-4: the onset is step 3, the last good step 2.
    assert (collapse.onset, collapse.last_good_step) == (3, 2)
    assert "below 0.5 x its peak 1.000 for 3 steps" in collapse.cause


def test_the_decline_is_where_the_smoothed_reward_last_left_near_its_peak():
    # window 2, drop 0.5, patience 2. A slow drift: smoothed 1.0 at step 2 (peak), .95 (near: >= 0.9 x 1.0), .8
    # at 4 (below 0.9: the decline's smoothed step, so its window starts at 3), .65, .55 (not below .5), .4 at 7
    # (streak starts), .25 at 8: fires. Onset 6 (last good step 5, smoothed .55: already half-way down); the
    # decline 3, so a near-peak rollback returns to step 2 or earlier.
    detector = CollapseDetector(window=2, drop=0.5, patience=2)
    [(step, drift)] = _feed(detector, [1.0, 1.0, 0.9, 0.7, 0.6, 0.5, 0.3, 0.2])
    assert (step, drift.onset, drift.decline) == (8, 6, 3)
    assert (drift.good_step("onset"), drift.good_step("near-peak")) == (5, 2)
    # A dip that comes back near the peak is forgotten: smoothed 1.0, .85 (below near at 3), .85, 1.0 at 5 (near
    # again), .6 at 6 (below near: decline 5), .2 at 7 (streak), .2 at 8: fires. A sudden fall leaves the two
    # rollback points a step apart.
    detector = CollapseDetector(window=2, drop=0.5, patience=2)
    [(step, sudden)] = _feed(detector, [1.0, 1.0, 0.7, 1.0, 1.0, 0.2, 0.2, 0.2])
    assert (step, sudden.onset, sudden.decline) == (8, 6, 5)
    assert (sudden.good_step("onset"), sudden.good_step("near-peak")) == (5, 4)
    # The first test's sudden drop: smoothed .5 at step 3 is already below near: decline 2, one step before 3.
    [(_, drop)] = _feed(CollapseDetector(window=2, drop=0.5, patience=3), [1, 1, 0, 0, 0, 0])
    assert (drop.good_step("onset"), drop.good_step("near-peak")) == (2, 1)


def test_detector_ignores_noise_and_a_recovery_resets_the_streak():
    detector = CollapseDetector(window=2, drop=0.5, patience=3)
    # Smoothed: -, .5 (peak), .25 and .25 (half the peak is not below it), 1.0 (new peak), .5, 0 (streak 1),
    # .25 (streak 2): never 3 in a row.
    assert _feed(detector, [0.5, 0.5, 0.0, 0.5, 1.5, -0.5, 0.5, 0.0]) == []
    # A policy that never earned reward cannot collapse: 0 >= 0.5 x 0.
    assert _feed(CollapseDetector(window=2, patience=1), [0, 0, 0, 0]) == []


def test_detector_reset_forgets_the_peak():
    detector = CollapseDetector(window=1, drop=0.5, patience=1)
    assert [step for step, _ in _feed(detector, [1.0, 0.2])] == [2]
    detector.reset()
    assert _feed(detector, [0.2, 0.2, 0.15], start=3) == []  # new peak 0.2; 0.15 >= 0.1


def test_detector_reset_can_hold_off_the_old_task_s_rewards():
    # A flip of the task before step 3: the first two batches after it still hold old-task episodes (0.9).
    # Without a hold they set the peak: smoothed .9 at step 4 (peak), .5 at 5 (not below .45), .1 at 6 (streak
    # starts), .1 at 7: fires at 7. Holding 2 steps, the new task's curve starts from its own level: smoothed
    # .1, .1, .1 never falls below .05.
    rewards = [0.9, 0.9, 0.1, 0.1, 0.1, 0.1]
    plain = CollapseDetector(window=2, drop=0.5, patience=2)
    plain.reset()
    assert [step for step, _ in _feed(plain, rewards, start=3)] == [7]
    held = CollapseDetector(window=2, drop=0.5, patience=2)
    held.reset(hold=2)
    assert _feed(held, rewards, start=3) == []
    with pytest.raises(ValueError, match="hold"):
        held.reset(hold=-1)


def test_detector_refuses_bad_settings():
    with pytest.raises(ValueError, match="drop"):
        CollapseDetector(drop=1.5)


def test_eval_rule_is_strictly_below_the_start():
    assert collapsed_on_eval(0.68, 0.69) and not collapsed_on_eval(0.69, 0.69)


def _record(step, **metrics):
    return {"step": step, "metrics": metrics}


def test_sweep_replay_and_summary_of_a_run_with_a_rollback():
    # Reward 0.8 for 10 steps, then 0 (default window 10, patience 10). The 10-step mean at step 15 is
    # 5 x 0.8 / 10 = 0.4, not below half the peak 0.8; at step 16 it is 0.32: the streak starts at 16 and the
    # rule fires 10 steps later, at step 25.
    history = [
        _record(
            s,
            **{
                "reward/mean": 0.8 if s <= 10 else 0.0,
                "policy/entropy": 0.1 * (s > 10),
                "dis/masked_frac_low": 0.01,
                "dis/masked_frac_high": 0.02 * (s == 20),
                "dis/approx_kl": 0.001 + 0.2 * (s == 12),
                "critic/explained_variance": 0.5,
                "adv/std": 0.0 if s % 5 == 0 else 0.3,  # steps 5, 10, 15, 20, 25: no signal
                "rollout/staleness_mean": 1.0 + (s == 25) * 25.0,
                "rollout/staleness_max": 3.0 + s // 10,
                "rollout/evicted": float(2 * s),  # a running count
                **({"rollout/mismatch_kl": 1e-4 * s} if s in (3, 4, 20) else {}),
            },
        )
        for s in range(1, 26)
    ]
    assert replay_collapses(history) == [25]
    history += [_record(26, **{"trainer/rollbacks": 1.0, "trainer/rollback_to": 10})]
    history += [_record(s, **{"reward/mean": 0.0, "trainer/rollbacks": 1.0}) for s in range(27, 40)]
    # After the rollback the detector starts over; 13 steps of 0 reward have no peak to fall from.
    assert replay_collapses(history) == [25]
    row = summarize(3, history, accuracy=0.5, sft_accuracy=0.6, minutes=2.0)
    assert (row.collapsed, row.collapse_step, row.cause, row.rollbacks) == (True, 25, "reward+eval", 1)
    assert row.delta == pytest.approx(-10.0) and row.peak_entropy == pytest.approx(0.1)
    assert row.max_masked_frac == pytest.approx(0.03) and row.final_reward == 0.0
    assert row.max_kl == pytest.approx(0.201)  # the spike at step 12
    assert math.isnan(row.final_ev)  # the last 10 steps logged no critic
    assert row.policy_updates == 25 - 5  # the 13 steps after the rollback logged no advantages
    # The first 50 steps with a reward: 10 x 0.8 then 28 x 0 (steps 11-25 and 27-39) -> 8 / 38.
    assert row.early_reward == pytest.approx(8 / 38) and row.evicted == 50 and row.staleness_max == 5
    assert row.staleness_mean == pytest.approx((25 + 25) / 25)  # 25 steps logged it, one of them 26
    assert row.mismatch_kl == pytest.approx(4e-4)  # the median of 3e-4, 4e-4 and 2e-3


def test_preset_learning_rate_warms_up_then_decays():
    """The preset's schedule (the stability fix, docs/stability.md): linear warm-up over 20 steps, cosine decay
    to 0.1 of the peak at step 200. Scale at 0-based step s: (s + 1) / 20 during warm-up, then
    0.1 + 0.45 * (1 + cos(pi * (s - 20) / 180))."""
    from components.config import load_config
    from components.training.rl.trainer import lr_scale

    train = load_config("tiny-cpu").train
    assert (train.warmup_steps, train.min_lr_ratio, train.max_steps) == (20, 0.1, 200)
    assert lr_scale(train, 0) == pytest.approx(0.05) and lr_scale(train, 19) == pytest.approx(1.0)
    assert lr_scale(train, 20) == pytest.approx(1.0)
    assert lr_scale(train, 110) == pytest.approx(0.55)  # halfway through the decay: cos(pi / 2) = 0
    assert lr_scale(train, 199) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 179 / 180)))


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_learning_rate_scale_reaches_both_optimizers(backend):
    import torch

    from components.training.engines.engine import ENGINES
    from components.training.engines.settings import EngineSettings

    engine = ENGINES[backend](torch.nn.Linear(3, 1), EngineSettings(2e-3))
    engine.set_lr_scale(0.25)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [pytest.approx(5e-4)] * len(
        engine.optimizer.param_groups
    )

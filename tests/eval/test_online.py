"""Per-phase reward and steps to recover after a preference flip, on hand-made reward curves."""

import pytest

from components.eval.online import phase_table, steps_to_recover


def test_steps_to_recover_counts_from_the_flip():
    # before = 0.8, fraction 0.9 -> target 0.72; window 2: k=1 mean(0.1)=0.1, k=2 mean(0.1,0.5)=0.3,
    # k=3 mean(0.5,0.9)=0.7 < 0.72, k=4 mean(0.9,0.9)=0.9 >= 0.72 -> 4
    assert steps_to_recover([0.1, 0.5, 0.9, 0.9], 0.8, window=2, fraction=0.9) == 4
    assert steps_to_recover([0.1, 0.2], 0.8, window=2, fraction=0.9) is None


def test_phase_table_on_two_flips():
    rewards = [0.2, 0.8, 0.8] + [0.0, 0.4, 0.8] + [0.9, 0.9]  # phases of 3 steps, the third cut short
    rows = phase_table(rewards, [("cute", 3), ("classical", 3)], window=2, fraction=1.0)
    assert [(r["style"], r["first_step"], r["last_step"]) for r in rows] == [
        ("cute", 1, 3),
        ("classical", 4, 6),
        ("cute", 7, 8),
    ]  # the schedule repeats
    assert rows[0]["reward_mean"] == pytest.approx(0.6) and rows[0]["reward_end"] == pytest.approx(0.8)
    assert rows[0]["steps_to_recover"] is None
    # phase 2 must reach 1.0 * 0.8: k=1 0.0, k=2 0.2, k=3 mean(0.4, 0.8)=0.6 -> never
    assert rows[1]["steps_to_recover"] is None and rows[1]["reward_end"] == pytest.approx(0.6)
    # phase 3 must reach 0.6: k=1 0.9 -> 1
    assert rows[2]["steps_to_recover"] == 1


def test_phase_table_rejects_bad_phases():
    with pytest.raises(ValueError, match="phases"):
        phase_table([0.1], [("cute", 0)])

"""The statistics of `sao experiment`'s table are the hand-computed ones: Student's t interval of an arm's mean,
Welch's interval against the reference arm, an arm's row, and each preference phase's ceiling and recovery."""

import math

import pytest

from components.eval.experiment_stats import ArmResult, arm_row, interval95, phase_rows, welch
from tests.factories import seed_result


def test_the_95_percent_interval_is_students_t():
    # mean 2, sample sd 1, n 3: t(0.975, 2) = 4.302653, half-width 4.302653 / sqrt(3) = 2.484138
    low, high = interval95([1.0, 2.0, 3.0])
    assert low == pytest.approx(2 - 2.484138, abs=1e-6) and high == pytest.approx(2 + 2.484138, abs=1e-6)
    # n 5, mean 90, sd 5: t(0.975, 4) = 2.776445, half-width 6.208
    low, high = interval95([85.0, 85.0, 90.0, 95.0, 95.0])
    assert (low, high) == pytest.approx((90 - 2.776445 * 5 / math.sqrt(5), 90 + 2.776445 * 5 / math.sqrt(5)), abs=1e-5)
    assert all(math.isnan(x) for x in interval95([0.9]))


def test_arms_are_compared_with_the_reference_by_welchs_interval():
    # a = [1, 2, 3], b = [2, 4, 6, 8]: difference -3, standard error sqrt(1/3 + 20/3/4) = sqrt(2), Welch's degrees of
    # freedom 2^2 / ((1/3)^2 / 2 + (5/3)^2 / 3) = 4.0755, t(0.975, 4.0755) = 2.7563: -3 -+ 3.8980.
    diff, low, high, p = welch([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0])
    assert diff == -3.0 and (low, high) == pytest.approx((-6.8980, 0.8980), abs=1e-4)
    assert p == pytest.approx(0.0999, abs=1e-4)  # |t| = 3 / sqrt(2) = 2.1213 on 4.0755 degrees of freedom
    assert all(math.isnan(x) for x in welch([1.0], [2.0, 3.0])[1:])


def test_an_arms_row_counts_collapses_with_their_steps():
    runs = [
        seed_result(0.90, seed=1),
        seed_result(0.20, seed=2, collapse_step=160, cause="reward+eval"),
        seed_result(0.60, seed=3, cause="eval", rollbacks=1),
    ]
    reference = ArmResult("sao", [seed_result(0.90, seed=1), seed_result(0.80, seed=2)], [[], []], "sweep-y")
    row = arm_row(ArmResult("grpo", runs, [[], [], []], "sweep-x"), reference)
    assert row["vs_reference"] == pytest.approx(56.6667 - 85.0, abs=1e-4) and row["p"] > 0.05
    assert math.isnan(arm_row(reference, reference)["vs_reference"])
    assert row["runs"] == 3 and row["mean"] == pytest.approx(56.6667, abs=1e-4)
    assert (row["min"], row["max"]) == pytest.approx((20.0, 90.0))
    assert row["vs_sft"] == pytest.approx(56.6667 - 69.0, abs=1e-4)
    assert row["collapsed"] == 2 and row["collapse_steps"] == "160 -" and row["rollbacks"] == 1
    assert row["minutes"] == pytest.approx(4.5)
    assert row["policy_updates"] == ""  # no seed's result counted them (written before the count existed)


def test_an_arms_row_spans_the_steps_that_moved_the_policy():
    runs = [
        seed_result(0.9, seed=1, policy_updates=63),
        seed_result(0.8, seed=2, policy_updates=37),
        seed_result(0.7, seed=3),
    ]  # seed 3: unknown
    assert arm_row(ArmResult("grpo", runs, [[], [], []], "sweep-x"))["policy_updates"] == "37-63"
    same = [seed_result(0.9, seed=1, policy_updates=300), seed_result(0.8, seed=2, policy_updates=300)]
    assert arm_row(ArmResult("sao", same, [[], []], "sweep-y"))["policy_updates"] == "300"


def test_an_arms_row_says_what_its_runs_saw():
    runs = [
        seed_result(0.9, seed=1, early_reward=0.3, evicted=10, staleness_mean=2.0, staleness_max=8, mismatch_kl=2e-5),
        seed_result(0.8, seed=2, early_reward=0.5, evicted=30, staleness_mean=3.0, staleness_max=5, mismatch_kl=3e-4),
        seed_result(0.7, seed=3),  # written before these were measured: left out of each
    ]
    row = arm_row(ArmResult("sao-r3-evict", runs, [[], [], []], "sweep-x"))
    assert row["early_reward"] == pytest.approx(0.4) and row["staleness_mean"] == pytest.approx(2.5)
    assert (row["evicted"], row["staleness_max"], row["mismatch_kl"]) == ("10-30", "5-8", "2.0e-05 to 3.0e-04")
    unknown = arm_row(ArmResult("old", [seed_result(0.7)], [[]], "sweep-y"))
    assert math.isnan(unknown["early_reward"]) and (unknown["evicted"], unknown["mismatch_kl"]) == ("", "")


def test_phase_rows_give_each_phases_ceiling_and_recovery_over_seeds():
    # Phases of 4 steps; the window is 5 steps, so a phase's ceiling is its mean. Seed 1 reaches 0.9 * 0.8 = 0.72 with
    # the mean of phase 2's first 4 steps (0.75) and never in phase 3 (0.9 * 0.75 = 0.675); seed 2 at the first step.
    curves = [
        [0.8, 0.8, 0.8, 0.8, 0.1, 0.9, 1.0, 1.0, 0.0, 0.1, 0.2, 0.3],
        [0.6, 0.6, 0.6, 0.6, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7],
    ]
    phases = [("cute", 4), ("chuunibyou", 4), ("classical", 4)]
    rows = phase_rows(ArmResult("sao", [seed_result(0.9, seed=1), seed_result(0.9, seed=2)], curves, "sweep-x"), phases)
    assert [r["style"] for r in rows] == ["cute", "chuunibyou", "classical"]
    assert rows[0]["ceiling_mean"] == pytest.approx(0.7) and rows[0]["recovered"] == "-"
    assert (rows[1]["ceiling_min"], rows[1]["ceiling_max"]) == pytest.approx((0.7, 0.75))
    assert rows[1]["recovered"] == "2/2" and rows[2]["recovered"] == "1/2"
    assert rows[1]["recover_steps_mean"] == pytest.approx(2.5) and rows[2]["recover_steps_mean"] == pytest.approx(1.0)

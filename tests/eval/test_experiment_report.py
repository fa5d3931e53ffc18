"""The experiment's report: results.md holds the arm table with the reference named in its heading, NaN and empty
cells as `-`, rewards and p to 3 decimals, points and minutes to 1; the CSV, the JSON and the plot beside it."""

import csv
import json

from components.eval.experiment_report import write_report
from components.eval.experiment_stats import ArmResult
from tests.factories import seed_result


def test_the_report_writes_the_arm_table_as_markdown_csv_and_json(tmp_path):
    # One seed per arm: no interval (`-`); grpo against sao: 50 - 80 = -30 points, no Welch interval with one run.
    results = [
        ArmResult(
            "sao",
            [seed_result(0.80, policy_updates=3, early_reward=0.4, evicted=7, staleness_mean=2.5, staleness_max=6)],
            [[0.1, 0.5, 0.8]],
            "sweep-a",
        ),
        ArmResult(
            "grpo",
            [seed_result(0.50, collapse_step=12, rollbacks=2, final_reward=0.25, minutes=2.0)],
            [[0.1, 0.2]],
            "sweep-b",
        ),
    ]
    report = write_report(tmp_path, "demo", "Claims: none.", "sao", results, [])
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert lines[:3] == ["# Experiment demo", "", "Claims: none."]
    assert "| vs SFT (points) | vs sao (points) | 95% CI low |" in lines[4]
    # sao: vs SFT 80 - 69 = 11.0 points; itself is no reference (`-`); 3 steps moved the policy; final reward 0.800.
    # First 50 steps' reward 0.400, 7 evicted, staleness 2.5 / 6, no mismatch logged (`-`). grpo's result predates
    # the count of policy updates and what the run saw: `-`.
    assert lines[6:] == [
        "| sao | 1 | 80.0 | 80.0 | 80.0 | - | - | 11.0 | - | - | - | - | 0 | - | 0 | 3 | 0.400 | 7 | 2.5 | 6 | - "
        "| 0.800 | 1.5 |",
        "| grpo | 1 | 50.0 | 50.0 | 50.0 | - | - | -19.0 | -30.0 | - | - | - | 1 | 12 | 2 | - | - | - | - | - | - "
        "| 0.250 | 2.0 |",
    ]
    assert report["report"] == str(tmp_path / "results.md") and report["phases"] == []
    assert [row["arm"] for row in csv.DictReader((tmp_path / "results.csv").open())] == ["sao", "grpo"]
    assert json.loads((tmp_path / "results.json").read_text())["runs"]["grpo"][0]["collapse_step"] == 12
    assert (tmp_path / "curves.png").stat().st_size > 10_000

"""The report of an experiment (`sao experiment`, components/stages/experiment.py), from its arms' results:

    <out>/results.{md,csv,json}  the table per arm (components/eval/experiment_stats.py) and, with a preference
                                 schedule, per phase; the JSON adds every seed's row
    <out>/curves.png             reward per step per arm (mean, min-max band) and each seed's held-out accuracy

`<out>` is the stage's `home/experiments/<label>/`.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from components.eval.experiment_stats import ArmResult, arm_row, phase_rows
from components.eval.tables import markdown_table
from components.storage import write_json

ARM_COLUMNS = {
    "arm": "arm",
    "runs": "runs",
    "mean": "held-out % mean",
    "min": "min",
    "max": "max",
    "ci95_low": "95% CI low",
    "ci95_high": "95% CI high",
    "vs_sft": "vs SFT (points)",
    "vs_reference": "vs the reference (points)",
    "vs_reference_low": "95% CI low",
    "vs_reference_high": "95% CI high",
    "p": "p (Welch)",
    "collapsed": "collapsed",
    "collapse_steps": "collapse steps",
    "rollbacks": "rollbacks",
    "policy_updates": "steps that moved the policy",
    "early_reward": "reward, first 50 steps",
    "evicted": "evicted",
    "staleness_mean": "staleness, mean",
    "staleness_max": "staleness, max",
    "mismatch_kl": "mismatch KL (run medians)",
    "final_reward": "final reward",
    "minutes": "minutes",
}
PHASE_COLUMNS = {
    "arm": "arm",
    "phase": "phase",
    "style": "style",
    "ceiling_mean": "reward, last 5 steps (mean)",
    "ceiling_min": "min",
    "ceiling_max": "max",
    "recover_steps_mean": "steps to recover (mean)",
    "recovered": "recovered",
}
FRACTIONS = {"p", "final_reward", "early_reward", "ceiling_mean", "ceiling_min", "ceiling_max"}
"""Columns shown to 3 decimals; the others are points or steps, shown to 1."""


def write_report(
    out: Path, label: str, about: str, reference: str, results: list[ArmResult], phases: list[tuple[str, int]]
) -> dict:
    """The table, titled `label` with the paragraph `about` under it, each arm compared with the arm named
    `reference`; the phase table when `phases` (the preference schedule) is not empty; the plot. Returns
    `{"table": [rows], "phases": [rows], "report": path of results.md}`."""
    versus = next((r for r in results if r.arm == reference), None)
    rows = [arm_row(r, versus) for r in results]
    schedule_rows = [row for r in results for row in phase_rows(r, phases)] if phases else []
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    (out / "results.csv").write_text(buffer.getvalue())
    write_json(
        out / "results.json",
        {"table": rows, "phases": schedule_rows, "runs": {r.arm: [asdict(s) for s in r.runs] for r in results}},
    )
    columns = ARM_COLUMNS | {"vs_reference": f"vs {reference} (points)"}
    lines = [f"# Experiment {label}", "", about, "", markdown_table(rows, columns, _cell)]
    if schedule_rows:
        schedule = ", ".join(f"{style} {steps} steps" for style, steps in phases)
        lines += ["", f"Per preference phase ({schedule}):", "", markdown_table(schedule_rows, PHASE_COLUMNS, _cell)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(out / "curves.png", label, results)
    return {"table": rows, "phases": schedule_rows, "report": str(out / "results.md")}


def _cell(key: str, value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.3f}" if key in FRACTIONS else f"{value:.1f}"
    return str(value) if value != "" else "-"


def plot(path: Path, label: str, results: list[ArmResult]) -> None:
    """Left: reward per step per arm (mean over seeds, min-max band, 5-step moving mean). Right: each seed's held-out
    accuracy per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, finals) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for i, result in enumerate(results):
        color = f"C{i}"
        length = min((len(c) for c in result.curves if c), default=0)
        if length:
            smooth = [_moving_mean(c[:length], 5) for c in result.curves if c]
            steps = range(1, length + 1)
            columns = list(zip(*smooth))
            curves.plot(steps, [statistics.fmean(c) for c in columns], color=color, label=result.arm)
            curves.fill_between(steps, [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.15)
        accs = [100 * r.accuracy for r in result.runs]
        finals.scatter([i] * len(accs), accs, color=color, alpha=0.7)
        finals.hlines(statistics.fmean(accs), i - 0.3, i + 0.3, color=color)
    curves.set(xlabel="policy step", ylabel="reward/mean (5-step moving mean)", title=f"{label}: training reward")
    curves.legend(fontsize=8)
    finals.set(ylabel="held-out accuracy %", title="after training, per seed")
    finals.set_xticks(range(len(results)), [r.arm for r in results], rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]

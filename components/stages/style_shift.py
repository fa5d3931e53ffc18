"""The style-shift stage: online learning while the reward's preference flips (cute -> chuunibyou -> classical).

The same schedule is trained once per algorithm, each under its own name so their checkpoints never mix; the
report is a table of reward per phase and steps to recover after each flip (components/eval/online.py), and a
plot of the reward curves: `reports/style-shift.{md,json,png}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from components.config import STYLES, Config
from components.eval import online
from components.eval.online import phase_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)


def schedule(steps_per_phase: int) -> str:
    """`env.preference_schedule`: every style for `steps_per_phase` policy updates, in order."""
    if steps_per_phase < 1:
        raise ValueError(f"steps_per_phase: must be >= 1, got {steps_per_phase}")
    return ",".join(f"{style}:{steps_per_phase}" for style in STYLES)


def run_name(cfg: Config, algo: str) -> str:
    return f"{cfg.name}-style-{algo}"


def run_overrides(cfg: Config, overrides: list[str], algo: str, steps_per_phase: int) -> list[str]:
    """The overrides of `algo`'s run: the style environment on the schedule, under its own name."""
    return list(overrides) + [
        'env.name="style"',
        f'env.preference_schedule="{schedule(steps_per_phase)}"',
        f'train.algo="{algo}"',
        f"train.max_steps={steps_per_phase * len(STYLES)}",
        f'name="{run_name(cfg, algo)}"',
    ]


def reward_curve(home: Path, cfg: Config, algo: str) -> list[float]:
    """`reward/mean` per policy step of `algo`'s run, from its JSON lines."""
    return online.reward_curve(Path(home) / "runs" / run_name(cfg, algo) / f"{algo}.jsonl")


def phase_rows(curves: dict[str, list[float]], steps_per_phase: int) -> list[dict]:
    """One row per algorithm and phase (components/eval/online.py)."""
    phases = [(style, steps_per_phase) for style in STYLES]
    return [{"algo": algo, **row} for algo, curve in curves.items() for row in phase_table(curve, phases)]


def write_report(out: Path, rows: list[dict], curves: dict[str, list[float]], steps_per_phase: int, table: str) -> Path:
    """`style-shift.json` (rows and curves), `style-shift.md` (`table`) and `style-shift.png` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "style-shift.json").write_text(json.dumps({"phases": rows, "curves": curves}, indent=1))
    (out / "style-shift.md").write_text(table + "\n")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for algo, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=algo, linewidth=1)
    for k in range(1, len(STYLES)):
        ax.axvline(k * steps_per_phase + 0.5, color="grey", linestyle=":")
    ax.set(xlabel="policy step", ylabel="reward/mean", title="reward while the preferred style flips")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "style-shift.png", dpi=110)
    plt.close(fig)
    return out / "style-shift.md"

"""`style_shift`: online learning while the reward's preference flips (cute -> chuunibyou -> classical).

The same schedule is trained once per algorithm (default: the critic-based SAO run and the running-mean baseline),
each under its own name so their checkpoints never mix; the artifact is a table of reward per phase and steps to
recover after each flip, and a plot of the reward curves (`reports/style-shift.{md,json,png}`).
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from components.pipeline.online import phase_table
from components.tracking import DiskTracker
from flows.common import context, markdown_table
from flows.train import train

STYLES = ("cute", "chuunibyou", "classical")


@flow(name="style_shift")
def style_shift(preset: str = "tiny-cpu", overrides: list[str] | None = None, home: str | None = None,
                steps_per_phase: int = 60, algos: list[str] | None = None,
                parent_run_id: str | None = None) -> dict:
    """Returns the per-phase table of every algorithm and where the report is."""
    if steps_per_phase < 1:
        raise ValueError(f"steps_per_phase: must be >= 1, got {steps_per_phase}")
    algos = list(algos or ["sao", "sao-running-mean"])
    schedule = ",".join(f"{style}:{steps_per_phase}" for style in STYLES)
    ctx = context(preset, overrides, home)
    tables: dict[str, list[dict]] = {}
    curves: dict[str, list[float]] = {}
    for algo in algos:
        name = f"{ctx.cfg.name}-style-{algo}"
        run_overrides = list(overrides or []) + [
            'env.name="style"', f'env.preference_schedule="{schedule}"', f'train.algo="{algo}"',
            f"train.max_steps={steps_per_phase * len(STYLES)}", f'name="{name}"']
        train(preset, run_overrides, str(ctx.home), resume=True, evaluate=False, parent_run_id=parent_run_id)
        records = DiskTracker.read(ctx.home / "runs" / name / f"{algo}.jsonl")
        by_step = {r["step"]: r["metrics"]["reward/mean"] for r in records if "reward/mean" in r.get("metrics", {})}
        curves[algo] = [by_step[s] for s in sorted(by_step)]
        tables[algo] = phase_table(curves[algo], [(s, steps_per_phase) for s in STYLES])
    rows = [{"algo": algo, **row} for algo, table in tables.items() for row in table]
    report = _write_report(ctx.home / "reports", rows, curves, steps_per_phase)
    create_markdown_artifact(key="style-shift", markdown=f"# Style shift ({schedule})\n\n{markdown_table(rows)}")
    return {"phases": rows, "report": str(report)}


def _write_report(out, rows: list[dict], curves: dict[str, list[float]], steps_per_phase: int):
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "style-shift.json").write_text(json.dumps({"phases": rows, "curves": curves}, indent=1))
    (out / "style-shift.md").write_text(markdown_table(rows) + "\n")
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

"""`style_shift`: online learning while the reward's preference flips (cute -> chuunibyou -> classical).

The same schedule is trained once per algorithm (default: the critic-based SAO run and the running-mean baseline),
each under its own name so their checkpoints never mix; the artifact is a table of reward per phase and steps to
recover after each flip, and a plot of the reward curves (`reports/style-shift.{md,json,png}`).
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from components.stages import style_shift as stage
from flows.common import context, markdown_table
from flows.train import train


@flow(name="style_shift")
def style_shift(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    steps_per_phase: int = 60,
    algos: list[str] | None = None,
    parent_run_id: str | None = None,
) -> dict:
    """Returns the per-phase table of every algorithm and where the report is."""
    schedule = stage.schedule(steps_per_phase)
    algos = list(algos or ["sao", "sao-running-mean"])
    ctx = context(preset, overrides, home)
    curves: dict[str, list[float]] = {}
    for algo in algos:
        run_overrides = stage.run_overrides(ctx.cfg, list(overrides or []), algo, steps_per_phase)
        train(preset, run_overrides, str(ctx.home), resume=True, evaluate=False, parent_run_id=parent_run_id)
        curves[algo] = stage.reward_curve(ctx.home, ctx.cfg, algo)
    rows = stage.phase_rows(curves, steps_per_phase)
    report = stage.write_report(ctx.home / "reports", rows, curves, steps_per_phase, markdown_table(rows))
    create_markdown_artifact(key="style-shift", markdown=f"# Style shift ({schedule})\n\n{markdown_table(rows)}")
    return {"phases": rows, "report": str(report)}

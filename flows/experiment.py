"""`experiment`: one of the paper's claims measured as arms x seeds from one shared SFT policy
(components/stages/experiment.py); the artifact is the table per arm (held-out accuracy: mean, min-max, 95%
interval; collapses and their steps) and, for `style-shift`, per preference phase. Re-running continues where it
stopped: finished seeds are read back, an interrupted one resumes from its newest checkpoint."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from components.stages import experiment as stage
from flows.common import context


@flow(name="experiment")
def experiment(
    name: str = "value-pretraining",
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    setting: str = "default",
    quick: bool = False,
    seeds: int | None = None,
    arms: list[str] | None = None,
) -> dict:
    """Returns the table rows, the phase rows (style-shift) and where the report is."""
    ctx = context(preset, overrides, home)
    result = stage.run_experiment(
        name, preset, list(overrides or []), ctx.home, setting, quick, seeds, arms, log=ctx.log
    )
    create_markdown_artifact(key=f"experiment-{name}", markdown=Path(result["report"]).read_text())
    return result

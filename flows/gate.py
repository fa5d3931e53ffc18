"""`gate`: a Great Expectations suite over a stored dataset, distilled traces or rollout logs (Parquet, local or
s3://). A failing gate fails the flow with a report naming each failing expectation and its first offending rows;
the report is also the run's artifact."""

from __future__ import annotations

from typing import Literal

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components.stages import gate as stage
from flows.common import IO_RETRIES, NO_CACHE, context


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def read_dataset(kind: str, uri: str) -> list:
    """Traces or trajectories from a Parquet file or object (I/O: retried)."""
    return stage.read_dataset(kind, uri)


@task(cache_policy=NO_CACHE)
def check(cfg, kind: str, rows: list):
    return stage.check(cfg, kind, rows)


@flow(name="gate")
def gate(
    uri: str,
    kind: Literal["traces", "rollouts"] = "traces",
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
) -> dict:
    """Returns the report as a dict; raises `GateFailed` when an expectation fails."""
    ctx = context(preset, overrides, home)
    report = check(ctx.cfg, kind, read_dataset(kind, uri))
    create_markdown_artifact(
        key=f"gate-{kind}", markdown=f"# Gate ({kind}, {uri}): {report.summary()}\n\n{report.markdown()}"
    )
    ctx.log(f"gate: {report.summary()}")
    report.raise_if_failed()
    return report.to_dict()

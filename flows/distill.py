"""`distill`: a teacher writes TIR traces, the gate checks them, they become a versioned dataset in the store.

    teacher -> traces -> gate (Great Expectations) -> data/sft-<env>-<hash>/ -> MLflow dataset input

Skipped when the dataset for the same inputs is already complete in the home or the store.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components.stages import distill as stage
from components.stages.home import artifact_uri
from components.stages.recipes import dataset_key
from flows.common import IO_RETRIES, NO_CACHE, context, markdown_table, tracked


@task(cache_policy=NO_CACHE)
def write_traces(cfg, log) -> stage.Distilled:
    progress = _progress(log)
    return stage.write_teacher_traces(cfg, log, progress)


@task(cache_policy=NO_CACHE)
def gate_traces(cfg, traces):
    return stage.gate_traces(cfg, traces)


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def save_dataset(cfg, home, distilled, report, log):
    return stage.save_dataset(cfg, home, distilled, report, log)


@flow(name="distill")
def distill(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    parent_run_id: str | None = None,
) -> str:
    """Returns the dataset's URI."""
    ctx = context(preset, overrides, home)
    cfg, log = ctx.cfg, ctx.log
    key = dataset_key(cfg)
    if stage.existing_dataset(cfg, ctx.home, log) is not None:
        log(f"distill: {key} is complete for these inputs; skipped")
        return artifact_uri(cfg.store, ctx.home, key)
    with tracked(ctx, "distill", parent_run_id) as run:
        distilled = write_traces(cfg, log)
        report = gate_traces(cfg, distilled.traces)
        create_markdown_artifact(key="gate-traces", markdown=f"# Trace gate: {report.summary()}\n\n{report.markdown()}")
        log(f"gate: {report.summary()}")
        report.raise_if_failed()
        path = save_dataset(cfg, ctx.home, distilled, report, log)
        uri = artifact_uri(cfg.store, ctx.home, key)
        run.log_dataset(stage.dataset_rows(path), source=uri, name=key)
        run.log_metrics(
            {
                "distill/traces": len(distilled.traces),
                "distill/rejected": sum(distilled.rejected.values()),
                "distill/teacher_seconds": distilled.seconds,
            }
        )
    create_markdown_artifact(
        key="distill",
        markdown=markdown_table(
            [
                {
                    "dataset": uri,
                    "teacher": cfg.distill.teacher,
                    "traces": len(distilled.traces),
                    "rejected": sum(distilled.rejected.values()),
                    "gate": "passed",
                }
            ]
        ),
    )
    return uri


def _progress(log):
    """`(done, total)` -> a log line at every tenth of the way."""
    marks: set[int] = set()

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth not in marks:
            marks.add(tenth)
            log(f"distill: {done}/{total} problems")

    return progress

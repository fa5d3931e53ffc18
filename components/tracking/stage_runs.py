"""MLflow runs of the pipeline: one parent run per pipeline, one nested run per stage, and runs found again by a
tag (a sweep's parent). Each is an `MlflowTracker`, so every call goes through the spool like the training run's.

A stage run carries the config as parameters, its headline numbers as metrics, the datasets it read as run inputs
and its small reports as artifacts. A pipeline re-run (a retried flow) finds its parent run again by its key tag,
so the stages of a resumed pipeline stay under one parent. With `tracking.backend = "disk"` each is a
`NullTracker`: the JSON lines under the home remain the record.
"""

from __future__ import annotations

from pathlib import Path

from components.config import Config, to_dict
from components.tracking.mlflow_tracker import (
    MlflowTracker,
    mlflow_experiment,
    mlflow_uri,
    spool_dir,
)
from components.tracking.trackers import NullTracker

PIPELINE_TAG = "sao.pipeline"
STAGE_TAG = "sao.stage"
StageRun = MlflowTracker | NullTracker


def _run(
    cfg: Config,
    home: Path,
    run_name: str,
    tags: dict[str, str] | None = None,
    parent_run_id: str | None = None,
    run_id: str | None = None,
) -> MlflowTracker:
    home = Path(home).resolve()
    return MlflowTracker(
        mlflow_uri(cfg.tracking, home),
        cfg.tracking.experiment,
        run_name,
        artifact_root=(home / "mlartifacts").as_uri(),
        parent_run_id=parent_run_id,
        spool_dir=spool_dir(home),
        tags=tags,
        run_id=run_id,
    )


def find_run(cfg: Config, home: Path, tag: str, value: str, unfinished: bool = False) -> str | None:
    """The id of the newest run tagged `tag = value` (with `unfinished`, only one still open or failed)."""
    client, experiment = mlflow_experiment(cfg.tracking, home)
    runs = client.search_runs(
        [experiment], filter_string=f"tags.`{tag}` = '{value}'", order_by=["attributes.start_time DESC"], max_results=1
    )
    if not runs or (unfinished and runs[0].info.status == "FINISHED"):
        return None
    return runs[0].info.run_id


def pipeline_run(cfg: Config, home: Path, key: str) -> StageRun:
    """The pipeline's parent run for `key` (the pipeline's recipe): found again when a run with this key is still
    open or failed (a retried flow continues under it), else a new one with the config as parameters."""
    if cfg.tracking.backend == "disk":
        return NullTracker()
    found = find_run(cfg, home, PIPELINE_TAG, key, unfinished=True)
    if found is not None:
        return _run(cfg, home, "", run_id=found)
    run = _run(cfg, home, f"pipeline/{cfg.name}/{cfg.env.name}", tags={PIPELINE_TAG: key})
    run.log_params({"config": to_dict(cfg)})
    return run


def stage_run(cfg: Config, home: Path, stage: str, parent_run_id: str | None = None) -> StageRun:
    """A new run for `stage` (nested under `parent_run_id` when given), with the config as parameters."""
    if cfg.tracking.backend == "disk":
        return NullTracker()
    run = _run(cfg, home, f"{stage}/{cfg.name}/{cfg.env.name}", tags={STAGE_TAG: stage}, parent_run_id=parent_run_id)
    run.log_params({"config": to_dict(cfg)})
    return run


def tagged_run(
    cfg: Config, home: Path, tag: str, value: str, run_name: str, parent_run_id: str | None = None
) -> StageRun:
    """The run tagged `tag = value`, found again in any state (a re-run sweep continues under its parent), else
    a new one of that name; nested under `parent_run_id` when given (a found run is moved under it)."""
    if cfg.tracking.backend == "disk":
        return NullTracker()
    found = find_run(cfg, home, tag, value)
    if found:
        return _run(cfg, home, run_name, run_id=found, parent_run_id=parent_run_id)
    return _run(cfg, home, run_name, tags={tag: value}, parent_run_id=parent_run_id)


def reopen(cfg: Config, home: Path, run_id: str | None) -> StageRun:
    """The existing run `run_id`, to log more into it (None, or tracking on disk: a `NullTracker`)."""
    if cfg.tracking.backend == "disk" or not run_id:
        return NullTracker()
    return _run(cfg, home, "", run_id=run_id)

"""MLflow runs of the pipeline: one parent run per pipeline, one nested run per stage (DESIGN section 6).

A stage run carries the config as parameters, its headline numbers as metrics (one batched call), the datasets it
read as run inputs and its small reports as artifacts. A pipeline re-run (a retried flow) finds its parent run
again by its key tag, so the stages of a resumed pipeline stay under one parent.

With `tracking.backend = "disk"` every call is a no-op (`NullRun`): the JSON lines under the home remain the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.config import Config, to_dict
from components.tracking.mlflow_tracker import log_metrics_batched, log_params_batched, mlflow_experiment

PIPELINE_TAG = "sao.pipeline"
STAGE_TAG = "sao.stage"


class NullRun:
    """The run of a stage when MLflow is off."""

    run_id: str | None = None

    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        pass

    def log_dataset(self, rows: list[dict], source: str, name: str, context: str = "training") -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def finish(self, failed: bool = False) -> None:
        pass


class StageRun(NullRun):
    """One MLflow run (a stage, or the pipeline's parent) driven through `MlflowClient`, never the fluent API: the
    fluent API keeps one global active run, which concurrent flow runs in one process would share."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log_params(self, params: dict) -> None:
        log_params_batched(self.client, self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        log_metrics_batched(self.client, self.run_id, metrics, step)

    def log_dataset(self, rows: list[dict], source: str, name: str, context: str = "training") -> None:
        """A dataset input (name, digest of its rows, source URI) shown on the run's page."""
        import warnings

        import mlflow.data
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag

        with warnings.catch_warnings():  # MLflow's notes on source resolution and integer columns, not ours
            warnings.simplefilter("ignore", UserWarning)
            dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name)
        entity = DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
        self.client.log_inputs(self.run_id, datasets=[entity])

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def pipeline_run(cfg: Config, home: Path, key: str) -> NullRun:
    """The pipeline's parent run for `key` (the pipeline's recipe): found again when a run with this key is still
    open or failed (a retried flow continues under it), else a new one with the config as parameters."""
    if cfg.tracking.backend == "disk":
        return NullRun()
    client, experiment = mlflow_experiment(cfg.tracking, home)
    runs = client.search_runs([experiment], filter_string=f"tags.`{PIPELINE_TAG}` = '{key}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if runs and runs[0].info.status != "FINISHED":
        client.update_run(runs[0].info.run_id, status="RUNNING")
        return StageRun(client, runs[0].info.run_id)
    run = client.create_run(experiment, run_name=f"pipeline/{cfg.name}/{cfg.env.name}", tags={PIPELINE_TAG: key})
    stage = StageRun(client, run.info.run_id)
    stage.log_params({"config": to_dict(cfg)})
    return stage


def stage_run(cfg: Config, home: Path, stage: str, parent_run_id: str | None = None) -> NullRun:
    """A new run for `stage` (nested under `parent_run_id` when given), with the config as parameters."""
    if cfg.tracking.backend == "disk":
        return NullRun()
    client, experiment = mlflow_experiment(cfg.tracking, home)
    tags = {STAGE_TAG: stage}
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment, run_name=f"{stage}/{cfg.name}/{cfg.env.name}", tags=tags)
    stage_run = StageRun(client, run.info.run_id)
    stage_run.log_params({"config": to_dict(cfg)})
    return stage_run

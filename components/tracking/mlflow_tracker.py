"""`MlflowTracker`: one MLflow run driven through `MlflowClient` and an on-disk spool, so a tracking server that
goes away delays the metrics but neither stops training nor loses them (`replay_spool` delivers what a finished
process left behind; components/tracking/spool.py). Every MLflow call of the project goes through here.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.tracking.spool import (
    LINEAGE_TAG,
    SPOOL_DIR,
    Courier,
    Spool,
    permanent,
    previous_run,
    replay_spool,
    spool_files,
)

logger = logging.getLogger("sao.tracking")

if TYPE_CHECKING:
    from components.config import TrackingConfig


class MlflowTracker:
    """One MLflow run per process. Each run carries a lineage tag (home, preset, algorithm), so a resumed
    process finds the run it continues: `rewind(step)` copies that run's history up to `step` into this run,
    tags both, and marks the crashed one KILLED. The resumed run then holds one contiguous curve, on any
    tracking server: MLflow has no API to delete metric points.

    Only creating the run talks to the server directly (a run that cannot start fails here, after three tries).
    Every later call is appended to a spool under `spool_dir` and delivered in order by
    a background thread (components/tracking/spool.py): while the server answers, a call waits up to `wait_s` for
    its delivery (so what was logged is visible when the call returns); while it does not, the call returns at
    once and training goes on. `close` waits up to `close_timeout_s` for the spool to drain; what is still
    undelivered stays on disk for `replay_spool`."""

    LINEAGE_TAG = LINEAGE_TAG

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        lineage: str = "",
        artifact_root: str | None = None,
        parent_run_id: str | None = None,
        spool_dir: str | Path | None = None,
        wait_s: float = 2.0,
        close_timeout_s: float = 30.0,
        retry_max_s: float = 10.0,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
    ) -> None:
        """A new run `run_name` in `experiment` (created with `artifact_root` when missing), tagged with `tags`,
        `lineage` (when set) and `parent_run_id` (shown nested under it); or with `run_id`, the existing run of
        that id, reopened (a pipeline's parent run found again, a finished training run given its evaluation)."""
        from mlflow.tracking import MlflowClient

        bound_mlflow_http()
        if spool_dir and spool_files(spool_dir):  # a killed run's last records first: rewind copies from it
            try:
                replay_spool(spool_dir, quiet=True)
            except Exception as exc:  # noqa: BLE001 - they stay on disk; this run can start without them
                logger.warning("MLflow: could not replay the spools left in %s (%s); they stay there", spool_dir, exc)
        self.client = MlflowClient(uri)
        self.lineage = lineage
        tags = {**(tags or {}), **({self.LINEAGE_TAG: lineage} if lineage else {})}
        if parent_run_id:  # shown nested under its parent in the MLflow UI (a sweep's seeds, a pipeline's stages)
            tags["mlflow.parentRunId"] = parent_run_id
        for attempt in range(3):  # MLflow's own retries are off (HTTP_DEFAULTS): ride out a blip at start
            try:
                if run_id is not None:
                    run = self.client.get_run(run_id)
                    experiment_id = run.info.experiment_id
                    if run.info.status != "RUNNING":
                        self.client.update_run(run_id, status="RUNNING")
                    for key, value in tags.items():  # a reopened run keeps its tags; a parent given now nests it
                        if run.data.tags.get(key) != value:
                            self.client.set_tag(run_id, key, value)
                    break
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = (
                    found.experiment_id
                    if found
                    else self.client.create_experiment(experiment, artifact_location=artifact_root)
                )
                run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
                break
            except Exception as exc:
                if attempt == 2 or permanent(exc):
                    raise
                time.sleep(2.0 * (attempt + 1))
        self.experiment_id, self.run_id = experiment_id, run.info.run_id
        spool_dir = Path(spool_dir) if spool_dir else Path(tempfile.gettempdir()) / "sao-mlflow-spool"
        self.spool = Spool(
            spool_dir / f"{self.run_id}.jsonl",
            header={"run_id": self.run_id, "uri": uri, "experiment_id": experiment_id, "lineage": lineage},
        )
        """This run's outbox on disk (replay_spool delivers what a closed or killed tracker left in it)."""
        self.spool.lock()
        self.wait_s, self.close_timeout_s = wait_s, close_timeout_s
        self.courier = Courier(self.client, self.spool, retry_max_s)

    def _submit(self, op: dict) -> None:
        self.courier.submit(self.spool.append(op), self.wait_s)

    def log_params(self, params: dict) -> None:
        self._submit({"op": "params", "params": {k: str(v)[:6000] for k, v in flatten(params).items()}})

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        self._submit(
            {
                "op": "metrics",
                "step": step,
                "time_ms": int(time.time() * 1000),
                "metrics": {k: float(v) for k, v in metrics.items()},
            }
        )

    def log_dataset(self, rows: list[dict], source: str, name: str, context: str = "training") -> None:
        """A dataset input (name, digest of its rows, source URI, schema) shown on the run's page; the entity is
        made now, from the rows, and delivered through the spool like every other call."""
        import mlflow.data
        import pandas as pd  # with mlflow.data: only a stage that logs a dataset needs them

        with warnings.catch_warnings():  # MLflow's notes on source resolution and integer columns, not ours
            warnings.simplefilter("ignore", UserWarning)
            entity = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name)._to_mlflow_entity()
        self._submit(
            {
                "op": "dataset",
                "context": context,
                "dataset": {
                    "name": entity.name,
                    "digest": entity.digest,
                    "source_type": entity.source_type,
                    "source": entity.source,
                    "schema": entity.schema,
                    "profile": entity.profile,
                },
            }
        )

    def log_artifact(self, path: str | Path) -> None:
        """A file uploaded to the run's artifacts (delivered through the spool: the file must stay in place)."""
        self._submit({"op": "artifact", "path": str(Path(path).resolve())})

    def rewind(self, step: int) -> None:
        self._submit({"op": "rewind", "step": step})

    def previous_run(self) -> Any:
        """The newest other run of this lineage, or None."""
        return previous_run(self.client, self.spool.header)

    def close(self, failed: bool = False) -> None:
        self.courier.submit(self.spool.append({"op": "terminate", "status": "FAILED" if failed else "FINISHED"}), 0)
        left = self.courier.drain(self.close_timeout_s)
        if left:
            logger.warning(
                "MLflow: %d records of run %s were not delivered within %.0f s; they are kept in %s "
                "(deliver them with `sao tracking replay`)",
                left,
                self.run_id,
                self.close_timeout_s,
                self.spool.path,
            )
        if not self.courier.alive:  # a request still in flight keeps the spool locked until the process ends
            self.spool.close(remove=True)  # removed when all was delivered


HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's HTTP client retries every method 7 times over ~4 minutes, with a 120 s timeout, by default. A POST
retried after a read timeout may apply a log_batch twice, and a delivery thread held that long notices a
returning server late. The spool's courier retries instead (with backoff, checking the run's history before
resending a batch in doubt), so MLflow's own retries are off and each request is bounded to 10 s, unless the
environment sets these variables itself."""


def bound_mlflow_http() -> None:
    """Set MLflow's HTTP retry and timeout variables to `HTTP_DEFAULTS` where the environment leaves them unset
    (MLflow reads them on every request, process-wide)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def mlflow_experiment(config: TrackingConfig, home: Path) -> tuple[Any, str]:
    """(MlflowClient, experiment id) of `tracking.experiment`, created with its artifacts under the home."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri(config, home))
    found = client.get_experiment_by_name(config.experiment)
    experiment = (
        found.experiment_id
        if found
        else client.create_experiment(
            config.experiment, artifact_location=(Path(home).resolve() / "mlartifacts").as_uri()
        )
    )
    return client, experiment


def flatten(params: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mlflow_uri(config: TrackingConfig, home: Path) -> str:
    """The configured URI, else `$MLFLOW_TRACKING_URI`, else sqlite under the home."""
    return config.uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(home).resolve()}/mlflow.db"


def spool_dir(home: Path) -> Path:
    """Where a run home's MLflow spools live (`replay_spool` takes this directory, a spool file or the home)."""
    return Path(home).resolve() / SPOOL_DIR

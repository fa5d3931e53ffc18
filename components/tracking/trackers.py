"""Metric trackers behind one protocol (torchtune's MetricLoggerInterface pattern). Metrics are logged in
batches, one call per step with every metric of that step, never one call per point (docs/design.md, metrics).

`DiskTracker` writes JSON lines under the run home (the local record every run keeps); `MlflowTracker`
(components/tracking/mlflow_tracker.py) logs to any MLflow tracking URI through an on-disk spool; `FanOut` sends
each call to several. The Prometheus exporter (components/tracking/prometheus.py) is one more tracker, opened when
a port is set. `open_tracker` builds the training run's set.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from components.tracking.mlflow_tracker import MlflowTracker, mlflow_uri, spool_dir
from components.tracking.prometheus import PrometheusTracker

if TYPE_CHECKING:
    from components.config import TrackingConfig


class Tracker(Protocol):
    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None:
        """A run resumed from the checkpoint at `step`: forget metrics logged after it by the crashed run."""

    def close(self, failed: bool = False) -> None: ...


class NullTracker:
    """Records nothing: the other ranks of a run, tests, and every stage run with `tracking.backend = "disk"`
    (then the JSON lines under the home are the record)."""

    run_id: str | None = None

    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        pass

    def log_dataset(self, rows: list[dict], source: str, name: str, context: str = "training") -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


class FanOut:
    """Every call goes to each tracker in order."""

    def __init__(self, *trackers: Tracker) -> None:
        self.trackers = trackers

    @property
    def run_id(self) -> str | None:
        """The MLflow run id of the first tracker that has one (None without MLflow)."""
        return next((t.run_id for t in self.trackers if getattr(t, "run_id", None)), None)

    def log_params(self, params: dict) -> None:
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def rewind(self, step: int) -> None:
        for t in self.trackers:
            t.rewind(step)

    def close(self, failed: bool = False) -> None:
        for t in self.trackers:
            t.close(failed)


class DiskTracker:
    """JSON lines: one `{"step", "time", "metrics"}` record per step, appended and flushed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log_params(self, params: dict) -> None:
        self._write({"params": params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "time": time.time(), "metrics": metrics})

    def rewind(self, step: int) -> None:
        """Rewrite the file without the records of steps after `step` (atomically: temp file + rename)."""
        self._file.close()
        kept = [r for r in self.read(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".rewind")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self, failed: bool = False) -> None:
        self._file.close()

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def prometheus_port(config: TrackingConfig) -> int:
    """`tracking.prometheus_port`, else `$SAO_PROMETHEUS_PORT`, else 0 (no exporter)."""
    raw = os.environ.get("SAO_PROMETHEUS_PORT", "").strip()
    if config.prometheus_port or not raw:
        return config.prometheus_port
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"SAO_PROMETHEUS_PORT: expected a port number (0-65535), got {raw!r}")
    return int(raw)


def open_tracker(
    config: TrackingConfig, home: Path, run_name: str, jsonl: Path, parent_run_id: str | None = None
) -> Tracker:
    """The JSON lines under the home, plus MLflow unless `tracking.backend = "disk"` (nested under
    `parent_run_id` when given), plus the Prometheus exporter when a port is set (`prometheus_port`). Only the
    process that drives training opens one (rank 0 under torchrun: jobs.run_train gives the others a
    NullTracker), so one exporter serves the run. The exporter starts first: a port in use fails the run before
    an MLflow run is created."""
    port = prometheus_port(config)
    exporter: list[Tracker] = []
    if port:
        addr = config.prometheus_addr or os.environ.get("SAO_PROMETHEUS_ADDR", "").strip() or "127.0.0.1"
        exporter.append(PrometheusTracker(port, addr))
    trackers: list[Tracker] = [DiskTracker(jsonl)]
    if config.backend == "mlflow":
        home = Path(home).resolve()
        lineage = hashlib.sha256(f"{home}|{run_name}".encode()).hexdigest()[:16]
        trackers.append(
            MlflowTracker(
                mlflow_uri(config, home),
                config.experiment,
                run_name,
                lineage,
                artifact_root=(home / "mlartifacts").as_uri(),
                parent_run_id=parent_run_id,
                spool_dir=spool_dir(home),
            )
        )
    trackers += exporter  # last: the records of the step are written before it is served
    return trackers[0] if len(trackers) == 1 else FanOut(*trackers)

"""Where a run's record goes: the trackers (JSON lines, MLflow through a spool, Prometheus), the pipeline's stage
runs and the model registry.

    trackers.py        the `Tracker` protocol, `DiskTracker`, `FanOut`, `open_tracker`
    mlflow_tracker.py  `MlflowTracker`: every MLflow call, through the spool
    spool.py           the on-disk outbox and its courier thread; `replay_spool`
    stage_runs.py      the pipeline's parent run and one run per stage
    registry.py        registered model versions, `candidate` and `champion`
    prometheus.py      the trainer's and the engines' Prometheus series
"""

from components.tracking.mlflow_tracker import (
    MlflowTracker,
    mlflow_experiment,
    mlflow_uri,
    spool_dir,
)
from components.tracking.spool import replay_spool, spool_files
from components.tracking.trackers import (
    DiskTracker,
    FanOut,
    NullTracker,
    Tracker,
    open_tracker,
    prometheus_port,
)

__all__ = [
    "DiskTracker",
    "FanOut",
    "MlflowTracker",
    "NullTracker",
    "Tracker",
    "mlflow_experiment",
    "mlflow_uri",
    "open_tracker",
    "prometheus_port",
    "replay_spool",
    "spool_dir",
    "spool_files",
]

"""Trackers on real stores: JSON lines on disk and MLflow on sqlite."""

import pytest

from components.config import TrackingConfig
from components.tracking import DiskTracker, FanOut, MlflowTracker, mlflow_uri, open_tracker
from components.tracking.mlflow_tracker import flatten


def _mlflow(tmp_path, name="tiny/sao", lineage="L1") -> MlflowTracker:
    return MlflowTracker(
        f"sqlite:///{tmp_path}/mlflow.db", "sao", name, lineage, artifact_root=(tmp_path / "art").as_uri()
    )


def _history(tracker: MlflowTracker, key: str, run_id: str | None = None) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in tracker.client.get_metric_history(run_id or tracker.run_id, key)]


def test_flatten_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {"a.b": 1, "a.c.d": "x", "e": [1, 2]}


def test_mlflow_logs_params_and_metric_batches(tmp_path):
    t = _mlflow(tmp_path)
    params = {"config": {f"k{i}": i for i in range(150)}, "resumed_at": 0}  # > 100 params: two log_batch calls
    t.log_params(params)
    for step in (1, 2, 3):
        t.log_metrics({"policy/loss": step * 0.5, "dis/masked_frac_low": 0.0}, step)
    t.close()
    run = t.client.get_run(t.run_id)
    assert run.data.params["config.k149"] == "149" and run.data.params["resumed_at"] == "0"
    assert _history(t, "policy/loss") == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert run.info.status == "FINISHED"


def test_mlflow_rewind_continues_the_crashed_run_as_one_curve(tmp_path):
    crashed = _mlflow(tmp_path)
    for step in range(1, 6):  # checkpoint at 3, then killed at 5 (never closed: still RUNNING)
        crashed.log_metrics({"policy/loss": float(step)}, step)
    other = _mlflow(tmp_path, lineage="L2")  # a different home/run: must not be picked up
    other.log_metrics({"policy/loss": 99.0}, 1)

    resumed = _mlflow(tmp_path)
    resumed.rewind(3)
    for step in (4, 5, 6):
        resumed.log_metrics({"policy/loss": 10.0 + step}, step)
    resumed.close()
    assert _history(resumed, "policy/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    old = resumed.client.get_run(crashed.run_id)
    assert old.info.status == "KILLED"
    assert old.data.tags["sao.superseded_by_run"] == resumed.run_id
    assert resumed.client.get_run(resumed.run_id).data.tags["sao.resumed_from_run"] == crashed.run_id
    assert resumed.client.get_run(other.run_id).info.status == "RUNNING"


def test_mlflow_rewind_without_a_previous_run_is_a_no_op(tmp_path):
    t = _mlflow(tmp_path)
    t.rewind(5)
    t.close(failed=True)
    assert t.client.get_run(t.run_id).info.status == "FAILED"


def test_open_tracker_fans_out_to_disk_and_mlflow(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = open_tracker(TrackingConfig(), tmp_path, "tiny/sao", tmp_path / "runs" / "m.jsonl")
    assert isinstance(tracker, FanOut)
    tracker.log_metrics({"reward/mean": 0.25}, 1)
    tracker.close()
    assert DiskTracker.read(tmp_path / "runs" / "m.jsonl")[0]["metrics"] == {"reward/mean": 0.25}
    assert (tmp_path / "mlflow.db").exists()
    disk = open_tracker(TrackingConfig(backend="disk"), tmp_path, "x", tmp_path / "d.jsonl")
    assert isinstance(disk, DiskTracker)
    disk.close()


def test_mlflow_uri_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert mlflow_uri(TrackingConfig(uri="sqlite:///x.db"), tmp_path) == "sqlite:///x.db"
    assert mlflow_uri(TrackingConfig(), tmp_path) == "http://tracking:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert mlflow_uri(TrackingConfig(), tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"


def test_tracking_config_rejects_bad_backend():
    from components.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tracking.backend"):
        load_config("tiny-cpu", ['tracking.backend="wandb"'])

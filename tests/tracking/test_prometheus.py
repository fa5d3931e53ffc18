"""The trainer's Prometheus exporter over real loopback HTTP: series names, labels, values, and its wiring."""

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from components.config import TrackingConfig
from components.tracking import DiskTracker, FanOut, open_tracker, prometheus_port
from components.tracking.prometheus import EXPORTED, TRAINER_METRICS, PrometheusTracker, series_name
from tests.conftest import free_port

CONFIG = {"config": {"name": "tiny-cpu", "train": {"algo": "sao"}, "env": {"name": "tir_math"}}, "resumed_at": 0}
RUN = {"preset": "tiny-cpu", "algo": "sao", "env": "tir_math"}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of `http://127.0.0.1:<port>/metrics`."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def key(name: str, **extra: str) -> tuple[str, tuple]:
    return name, tuple(sorted({**RUN, **extra}.items()))


def test_series_names_follow_the_design_names():
    assert series_name("reward/mean") == "sao_reward_mean"
    assert series_name("dis/masked_frac_low") == "sao_dis_masked_frac_low"
    assert "sao_eval_accuracy" in EXPORTED and not any("eval_tir" in name for name in EXPORTED)
    assert len(EXPORTED) == len(set(EXPORTED))


def test_the_trainers_named_metric_lists_are_exported():
    # components/tracking/prometheus.py cannot import them (training imports tracking, which opens the exporter).
    from components.contracts.metrics import DIAGNOSTIC_METRICS

    assert set(DIAGNOSTIC_METRICS) <= set(TRAINER_METRICS)


def test_two_steps_serve_the_second_steps_values_with_the_run_labels():
    tracker = PrometheusTracker(0)
    try:
        tracker.log_params(CONFIG)
        tracker.log_metrics({"reward/mean": 0.25, "policy/loss": 1.5, "critic/explained_variance": 0.5}, 1)
        tracker.log_metrics(
            {
                "reward/mean": 0.75,
                "policy/loss": -0.5,
                "critic/explained_variance": math.nan,
                "debug/per_task/p17": 3.0,
            },
            2,
        )
        # The final evaluation, logged after training at version 0 and at the last version (stages.train.run_train).
        tracker.log_metrics({"eval/tir_math/accuracy": 0.5}, 0)
        tracker.log_metrics({"eval/tir_math/accuracy": 0.875}, 2)
        served = scrape(tracker.port)
    finally:
        tracker.close()
    assert served[key("sao_reward_mean")] == 0.75  # the second step's value, not the first's
    assert served[key("sao_policy_loss")] == -0.5
    assert math.isnan(served[key("sao_critic_explained_variance")])  # NaN stays NaN (a gap), not 0.5 of step 1
    assert served[key("sao_eval_accuracy", benchmark="tir_math")] == 0.875
    # Two rows held reward/mean: two training steps; the evaluation rows are not steps and keep the version at 2.
    assert served[key("sao_trainer_steps_total")] == 2
    assert served[key("sao_trainer_step")] == 2
    assert key("sao_trainer_last_step_timestamp_seconds") in served
    assert not any("debug" in name or "p17" in name for name, _ in served)  # not in EXPORTED: left out
    assert {name for name, _ in served} <= set(EXPORTED)


def test_rewind_moves_the_version_back_to_the_checkpoint():
    tracker = PrometheusTracker(0)
    try:
        tracker.log_params(CONFIG)
        tracker.log_metrics({"reward/mean": 0.5}, 5)
        tracker.rewind(3)  # resumed from the checkpoint of step 3
        assert scrape(tracker.port)[key("sao_trainer_step")] == 3
        tracker.log_metrics({"reward/mean": 0.5}, 4)
        assert scrape(tracker.port)[key("sao_trainer_step")] == 4
    finally:
        tracker.close()


def test_open_tracker_adds_the_exporter_and_close_frees_its_port(tmp_path, monkeypatch):
    monkeypatch.delenv("SAO_PROMETHEUS_PORT", raising=False)
    port = free_port()
    config = TrackingConfig(backend="disk", prometheus_port=port)
    tracker = open_tracker(config, tmp_path, "tiny-cpu/sao", tmp_path / "m.jsonl")
    assert isinstance(tracker, FanOut)
    assert [type(t) for t in tracker.trackers] == [DiskTracker, PrometheusTracker]
    try:
        tracker.log_params(CONFIG)
        tracker.log_metrics({"reward/mean": 0.5}, 1)
        assert scrape(port)[key("sao_reward_mean")] == 0.5
        with pytest.raises(OSError, match=rf"tracking.prometheus_port: cannot serve metrics on 127.0.0.1:{port} "):
            open_tracker(config, tmp_path, "tiny-cpu/sao", tmp_path / "other.jsonl")
    finally:
        tracker.close()
    again = open_tracker(config, tmp_path, "tiny-cpu/sao", tmp_path / "m.jsonl")  # a sweep's next seed
    again.close()
    assert isinstance(open_tracker(TrackingConfig(backend="disk"), tmp_path, "x", tmp_path / "d.jsonl"), DiskTracker)


def test_the_environment_variable_sets_the_port_when_the_config_does_not(monkeypatch):
    monkeypatch.setenv("SAO_PROMETHEUS_PORT", "9109")
    assert prometheus_port(TrackingConfig()) == 9109
    assert prometheus_port(TrackingConfig(prometheus_port=9200)) == 9200  # the config wins
    monkeypatch.setenv("SAO_PROMETHEUS_PORT", "nine")
    with pytest.raises(ValueError, match="SAO_PROMETHEUS_PORT: expected a port number"):
        prometheus_port(TrackingConfig())
    monkeypatch.delenv("SAO_PROMETHEUS_PORT")
    assert prometheus_port(TrackingConfig()) == 0

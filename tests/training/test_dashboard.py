"""dashboards/sao-training.json queries only series that a real run exports.

A short training run (2 steps on the tiny SFT policy) with the Prometheus exporter on, its episodes generated
by a real engine server over HTTP; the trainer's `/metrics` and the engine's `/metrics` are scraped, and every
`sao_*` name in the dashboard's queries must be among the scraped series.
"""

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from components.envs.registry import build_env
from components.rollout.embedded import EmbeddedEngine
from components.rollout.server import ServerThread, create_app
from components.stages.evaluate import run_eval
from components.tracking import open_tracker
from components.tracking.prometheus import EXPORTED, TRAINER_METRICS
from components.training.rl.trainer import train
from tests.conftest import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "sao-training.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SERIES = re.compile(r"sao_[a-z0-9_]+")


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL query: the panels' targets and the template variables' queries."""
    panels = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return panels + variables


def _scrape(url: str) -> list:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_dashboard_has_a_fixed_uid_and_a_templated_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "sao-training" and dashboard["title"] == "SAO training"
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for label in ("preset", "algo", "env"):
        assert variables[label]["query"]["query"] == f"label_values(sao_trainer_step, {label})"
        assert variables[label]["datasource"] == DATASOURCE
    assert [p["id"] for p in dashboard["panels"]] == list(range(1, len(dashboard["panels"]) + 1))
    for panel in dashboard["panels"]:
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"] == DATASOURCE for t in panel["targets"]), panel["title"]
    assert {name for q in _queries(dashboard) for name in SERIES.findall(q)} <= set(EXPORTED)


def test_every_dashboard_series_is_scraped_from_a_real_run(tmp_path, tiny_cfg, sft_dir, sft_policy):
    model, tokenizer = sft_policy
    port = free_port()
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=16, threads=1).start()
    live: list[dict] = []
    try:
        with ServerThread(create_app(engine, "tiny")) as engine_url:
            cfg = replace(
                tiny_cfg,
                task=replace(tiny_cfg.task, eval_size=4),
                train=replace(
                    # sync: each batch is sampled at the version it trains, so rollout/mismatch_kl is logged
                    tiny_cfg.train,
                    backend="torch",
                    batch_size=4,
                    max_steps=2,
                    checkpoint_every=1,
                    threads=1,
                    sync=True,
                ),
                rollout=replace(tiny_cfg.rollout, concurrency=4, backend="http", urls=(engine_url,)),
                tracking=replace(tiny_cfg.tracking, backend="disk", prometheus_port=port),
            )
            trainer_url = f"http://127.0.0.1:{port}"

            def on_checkpoint(step: int, uri: str) -> None:  # mid-run: the exporter serves the step just logged
                if step == 1:
                    live.extend(s for s in _scrape(trainer_url) if s.name == "sao_trainer_step")

            tracker = open_tracker(cfg.tracking, tmp_path, f"{cfg.name}/{cfg.train.algo}", tmp_path / "m.jsonl")
            try:
                result = train(
                    cfg, build_env(cfg), sft_dir, tmp_path, tracker, log=lambda _: None, on_checkpoint=on_checkpoint
                )
                # What stages.train.run_train logs after training: the held-out accuracy at the final version.
                accuracy = run_eval(cfg, result.policy_dir, tmp_path, "after", log=lambda _: None).accuracy
                tracker.log_metrics({f"eval/{cfg.env.name}/accuracy": accuracy}, result.version)
                trainer = _scrape(trainer_url)
            finally:
                tracker.close()
            served = _scrape(engine_url)
    finally:
        engine.shutdown()

    # A metric the trainer logs but the exporter leaves out is invisible to dashboards and alerts: add new ones
    # to TRAINER_METRICS (components/tracking/prometheus.py).
    assert set(result.history[-1]) - set(TRAINER_METRICS) == set()
    run = {"preset": "tiny-cpu", "algo": "sao", "env": "tir_math"}
    assert [(s.labels, s.value) for s in live] == [(run, 1.0)]
    value = {s.name: s.value for s in trainer if s.name != "sao_eval_accuracy"}
    assert all(s.labels == run for s in trainer if s.name != "sao_eval_accuracy")
    assert value["sao_trainer_step"] == 2 and value["sao_trainer_steps_total"] == 2
    assert value["sao_reward_mean"] == result.history[-1]["reward/mean"]
    assert [(s.labels["benchmark"], s.value) for s in trainer if s.name == "sao_eval_accuracy"] == [
        ("tir_math", accuracy)
    ]
    engine_value = {s.name: s.value for s in served}
    assert engine_value["sao_engine_weight_version"] == 2  # the trainer published versions 1 and 2 to it
    # Every model turn trained on was one completion the server answered (more may have been in flight).
    assert engine_value["sao_engine_requests_total"] >= sum(r["rollout/turns_mean"] * 4 for r in result.history)

    scraped = {s.name for s in trainer + served}
    assert scraped <= set(EXPORTED)
    wanted = {name for q in _queries(json.loads(DASHBOARD.read_text())) for name in SERIES.findall(q)}
    assert wanted - scraped == set(), "the dashboard queries series that a run does not export"

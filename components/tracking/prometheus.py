"""Live metrics as Prometheus series: the trainer's exporter (a `Tracker`) and the engine server's `/metrics`.

A metric logged under a docs/design.md section 6 name becomes the series `sao_` + the name with `/` replaced by `_`
(`reward/mean` -> `sao_reward_mean`), a gauge holding the value of the newest step. `eval/<benchmark>/accuracy`
becomes `sao_eval_accuracy{benchmark="<benchmark>"}`: the benchmark is a label, not part of the name, so a
new benchmark adds a series rather than a metric name. Trainer series carry the labels `preset`, `algo` and
`env`, constant over a run.

Only the series named in `EXPORTED` are exported; a metric logged under any other name is left out. The list
bounds the series a run can create (a name built from data, such as a per-task metric, cannot flood the
Prometheus server), and it is what dashboards and alerts are checked against (tests/training/test_dashboard.py).
A NaN value (an undefined metric at that step, e.g. a grad norm of a skipped update) is exported as
NaN, which Grafana draws as a gap: skipping it would leave the previous step's value on show as if current.

docs/metrics.md lists the series, their labels and ports, and the dashboard's panels.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from components.contracts.metrics import DESIGN_METRICS, DIAGNOSTIC_METRICS

TRAINER_METRICS = (
    *DESIGN_METRICS,  # docs/design.md section 6 (eval/<benchmark>/accuracy is EVAL_ACCURACY below)
    *DIAGNOSTIC_METRICS,
    # what the trainer logs beyond them (components/training/rl/trainer.py, algorithms.py, components/algo/losses.py,
    # components/rollout/backends.py, the style environment)
    "policy/clip_frac",
    "critic/clip_frac",
    "trainer/wait_s",
    "trainer/publish_s",
    "rollout/action_tokens",
    "trainer/lr_scale",
    "trainer/rollbacks",
    "trainer/rollback_to",
    "trainer/skipped_steps",
    "trainer/checkpoint_failures",
    "trainer/critic_skipped_steps",
    "rollout/engine_errors",
    "rollout/engines_live",
    "rollout/episodes_dropped",
    "rollout/malformed_calls",
    "rollout/transfer_s",
    "rollout/publish_bytes",
    "rollout/transfer_retries",
    "rollout/transfer_fallbacks",
    "rollout/transfer_senders",
    "rollout/probe_median_abs_diff",
    "rollout/probe_max_abs_diff",
    "rollout/probe_failures",
    "rollout/mismatch_kl",
    "rollout/evicted",
    "rollout/groups_dropped",
    "policy/advantages_whitened",
    "policy/kl_anchor",
    "env/preference",
)
"""Metric names (as logged) exported one-to-one as `sao_<name with / as _>` gauges."""

EVAL_ACCURACY = re.compile(r"eval/([^/]+)/accuracy")
"""`eval/<benchmark>/accuracy` -> `sao_eval_accuracy{benchmark=...}`."""

LABELS = ("preset", "algo", "env")
"""Labels of every trainer series, from the run's config (`name`, `train.algo`, `env.name`)."""

STEP_ROW = "reward/mean"
"""A logged row holding this metric is a training step (the trainer's per-step row; stages/train.py reads the same)."""


def series_name(metric: str) -> str:
    """`reward/mean` -> `sao_reward_mean`."""
    return "sao_" + metric.replace("/", "_")


TRAINER_SERIES = (
    "sao_trainer_step",
    "sao_trainer_max_steps",
    "sao_trainer_last_step_timestamp_seconds",
    "sao_trainer_steps_total",
    "sao_eval_accuracy",
    *(series_name(m) for m in TRAINER_METRICS),
)
ENGINE_SERIES = (
    "sao_engine_queue_depth",
    "sao_engine_tokens_per_second",
    "sao_engine_weight_version",
    "sao_engine_requests_total",
    "sao_engine_generated_tokens_total",
)
EXPORTED: tuple[str, ...] = TRAINER_SERIES + ENGINE_SERIES
"""Every series name this module can export (trainer exporter, then engine `/metrics`); nothing else is."""


class PrometheusTracker:
    """A `Tracker` that serves each step's metrics on `http://<addr>:<port>/metrics` until `close()`.

    A collector on its own `CollectorRegistry` (not prometheus_client's global one), so several can live in one
    process; a series appears once a value has been logged for it. The labels come from the config in
    `log_params` (the trainer logs it before any step; empty until then). `port=0` binds a free port (tests):
    `self.port` is the bound one."""

    def __init__(self, port: int, addr: str = "127.0.0.1") -> None:
        self.labels = {name: "" for name in LABELS}
        self.values: dict[tuple[str, str], float] = {}
        """(series, benchmark or "") -> the newest value."""
        self.step: int | None = None
        self.steps = 0
        self._lock = threading.Lock()  # log_metrics runs in the trainer's thread, collect in the server's
        self.registry = CollectorRegistry()
        self.registry.register(self)
        try:
            self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"tracking.prometheus_port: cannot serve metrics on {addr}:{port} "
                f"({exc.strerror}); choose a free port, or 0 for no exporter",
            ) from exc
        self.port = self._server.server_port

    def log_params(self, params: dict) -> None:
        config = params.get("config")
        if isinstance(config, dict):
            with self._lock:
                self.labels = {
                    "preset": str(config.get("name", "")),
                    "algo": str(config.get("train", {}).get("algo", "")),
                    "env": str(config.get("env", {}).get("name", "")),
                }
                # the target version: an exporter that vanishes before it crashed (SaoTrainerGone)
                max_steps = config.get("train", {}).get("max_steps")
                if max_steps is not None:
                    self.values["sao_trainer_max_steps", ""] = float(max_steps)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self._lock:
            for name, value in metrics.items():
                if name in TRAINER_METRICS:
                    self.values[series_name(name), ""] = float(value)
                elif (match := EVAL_ACCURACY.fullmatch(name)) is not None:
                    self.values["sao_eval_accuracy", match[1]] = float(value)
            # a late row (the final evaluation, logged at step 0) does not move the version back
            self.step = step if self.step is None else max(self.step, step)
            self.values["sao_trainer_step", ""] = float(self.step)
            if STEP_ROW in metrics:
                self.values["sao_trainer_last_step_timestamp_seconds", ""] = time.time()
                self.steps += 1

    def rewind(self, step: int) -> None:
        """A resumed run continues from `step`: the version goes back to it; the gauges hold until the next step."""
        with self._lock:
            self.step = step
            self.values["sao_trainer_step", ""] = float(step)

    def close(self, failed: bool = False) -> None:
        """Stop serving and free the port (a sweep opens the next seed's exporter on the same one)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def collect(self):
        with self._lock:
            labels, values, steps = self.labels, dict(self.values), self.steps
        names, label_values = [*labels], [*labels.values()]
        families: dict[str, GaugeMetricFamily] = {}
        for (series, benchmark), value in values.items():
            if series not in families:
                extra = ["benchmark"] if benchmark else []
                families[series] = GaugeMetricFamily(series, _DOCS[series], labels=names + extra)
            families[series].add_metric(label_values + ([benchmark] if benchmark else []), value)
        yield from families.values()
        if steps:
            counter = CounterMetricFamily("sao_trainer_steps", _DOCS["sao_trainer_steps_total"], labels=names)
            counter.add_metric(label_values, float(steps))
            yield counter


_DOCS = {series_name(m): f"SAO metric {m} at the newest step" for m in TRAINER_METRICS} | {
    "sao_eval_accuracy": "SAO metric eval/<benchmark>/accuracy, the newest value",
    "sao_trainer_step": "Newest step logged: the policy version",
    "sao_trainer_max_steps": "The run's target version (train.max_steps)",
    "sao_trainer_last_step_timestamp_seconds": "Unix time the newest training step was logged",
    "sao_trainer_steps_total": "Training steps logged by this process",
}


class EngineMetrics:
    """The engine server's series, read from the engine at scrape time: the hot path adds one integer per
    request (`request_done`), nothing per token. `sao_engine_tokens_per_second` is generated tokens over the
    last `window_s` seconds (at least; from the engine's start until then), sampled per request and per scrape."""

    def __init__(self, engine: Any, model: str, window_s: float = 30.0) -> None:
        self.engine, self.model, self.window_s = engine, model, window_s
        self.requests = 0
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), engine.stats.generated_tokens)])
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def request_done(self) -> None:
        """A completion was served."""
        self.requests += 1
        self._sample()

    def _sample(self) -> float:
        """Record (now, tokens generated) at most once a second; the rate over the window (tokens/s)."""
        now, total = time.monotonic(), self.engine.stats.generated_tokens
        with self._lock:
            if now - self._samples[-1][0] >= 1.0:
                self._samples.append((now, total))
            while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
                self._samples.popleft()
            start, base = self._samples[0]
        return (total - base) / (now - start) if now > start else 0.0

    def collect(self):
        labels = [self.model]
        values = (
            (
                GaugeMetricFamily,
                "sao_engine_queue_depth",
                "Requests waiting plus running in the engine",
                self.engine.in_flight,
            ),
            (
                GaugeMetricFamily,
                "sao_engine_tokens_per_second",
                "Generated tokens per second over the recent window",
                self._sample(),
            ),
            (GaugeMetricFamily, "sao_engine_weight_version", "Policy version the engine serves", self.engine.version),
            (CounterMetricFamily, "sao_engine_requests", "Completions served", self.requests),
            (
                CounterMetricFamily,
                "sao_engine_generated_tokens",
                "Tokens sampled by the engine",
                self.engine.stats.generated_tokens,
            ),
        )
        for family, name, doc, value in values:
            metric = family(name, doc, labels=["model"])
            metric.add_metric(labels, float(value))
            yield metric

    def render(self) -> tuple[bytes, str]:
        """(exposition text, its content type) for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

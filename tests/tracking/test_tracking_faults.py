"""The MLflow tracker across tracking-server outages: a real MLflow tracking server (its Flask app on a werkzeug
HTTP server in this process, sqlite behind it) reached through `tests/faultproxy.FaultProxy`, which resets
connections, stops listening or holds answers past the client's timeout.

What must hold: `log_metrics` returns promptly while the server is away, training goes on, and every step
reaches MLflow exactly once, in the run it was logged to, when the server returns, or later by `replay_spool`.
"""

import json
import threading
import time
from collections import Counter

import pytest

from components.cli import main
from components.tracking import MlflowTracker, replay_spool, spool_dir, spool_files
from tests.faultproxy import FaultProxy


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server on a free loopback port (one per module: starting one takes seconds)."""
    import os

    from mlflow.server import handlers
    from mlflow.server.constants import ARTIFACT_ROOT_ENV_VAR, BACKEND_STORE_URI_ENV_VAR
    from werkzeug.serving import make_server

    root = tmp_path_factory.mktemp("mlflow-server")
    # The server's app also sets MLFLOW_TRACKING_URI for its handlers: restored too, or every later test in
    # this process would track into this server's database.
    saved = {k: os.environ.get(k) for k in (BACKEND_STORE_URI_ENV_VAR, ARTIFACT_ROOT_ENV_VAR, "MLFLOW_TRACKING_URI")}
    os.environ[BACKEND_STORE_URI_ENV_VAR] = f"sqlite:///{root}/server.db"
    os.environ[ARTIFACT_ROOT_ENV_VAR] = (root / "artifacts").as_uri()
    handlers._tracking_store = None
    from mlflow.server import app

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    from mlflow.tracking import MlflowClient

    MlflowClient(url).search_experiments()  # the server creates its tables on the first request (seconds)
    yield url
    server.shutdown()
    handlers._tracking_store = None
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def short_timeouts(monkeypatch):
    """A 1 s request timeout, so an answer the proxy holds 2 s is a timed-out request (applied by the server)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def _tracker(proxy, tmp_path, lineage, **options) -> MlflowTracker:
    return MlflowTracker(
        proxy.url, "faults", f"run-{lineage}", lineage, spool_dir=spool_dir(tmp_path), retry_max_s=0.5, **options
    )


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_logged_through_an_outage_arrive_once(mlflow_server, tmp_path, short_timeouts):
    from mlflow.tracking import MlflowClient

    with FaultProxy(mlflow_server) as proxy:
        tracker = _tracker(proxy, tmp_path, "outage")
        tracker.log_params({"train": {"lr": 1e-3}})
        took: dict[int, float] = {}
        recovered_s = None  # from the server's return until the outage's backlog is delivered

        def caught_up() -> bool:
            nonlocal recovered_s
            if recovered_s is None and step >= 22 and tracker.courier.delivered_seq >= backlog:
                recovered_s = time.monotonic() - back
            return tracker.courier.delivered_seq == tracker.spool.last_seq

        for step in range(1, 31):
            if step == 5:  # the server applies this batch but answers after the client's 1 s timeout
                proxy.mode("slow", count=1, delay_s=2.0)
            if step == 10:
                proxy.mode("down")  # connections reset...
            if step == 15:
                proxy.stop()  # ...then nothing listens at all
            if step == 22:
                proxy.start()
                proxy.mode("pass")
                back, backlog = time.monotonic(), tracker.spool.last_seq
            started = time.monotonic()
            tracker.log_metrics({"policy/loss": step / 10, "reward/mean": -step}, step)
            took[step] = time.monotonic() - started
            caught_up()
            time.sleep(0.1)  # a training step
        while not caught_up():  # delivery catches up on its own, before close
            assert time.monotonic() - back < 30, "the spool was not delivered after the server returned"
            time.sleep(0.02)
        tracker.close()
        failed = proxy.stats()["failed"]
    client = MlflowClient(mlflow_server)
    assert _steps(client, tracker.run_id, "policy/loss") == list(range(1, 31))  # each step once: no duplicate
    assert _steps(client, tracker.run_id, "reward/mean") == list(range(1, 31))
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.001"
    assert failed > 0 and not tracker.spool.path.exists()  # delivered whole: the spool is gone
    slowest = max(took[s] for s in range(10, 22))
    print(
        f"log_metrics during the outage: max {slowest:.2f} s; {failed} requests failed at the proxy; "
        f"the outage's backlog delivered {recovered_s:.2f} s after the server returned"
    )
    assert slowest < 5


def test_server_down_through_close_leaves_the_spool_for_replay(mlflow_server, tmp_path, short_timeouts, capsys):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with FaultProxy(mlflow_server) as proxy:
        tracker = _tracker(proxy, tmp_path, "replay", close_timeout_s=2.0)
        for step in (1, 2, 3):
            tracker.log_metrics({"policy/loss": float(step)}, step)
        proxy.stop()
        for step in (4, 5, 6):
            tracker.log_metrics({"policy/loss": float(step)}, step)
        started = time.monotonic()
        tracker.close()
        close_s = time.monotonic() - started
        client = MlflowClient(mlflow_server)
        assert _steps(client, tracker.run_id, "policy/loss") == [1, 2, 3]
        assert client.get_run(tracker.run_id).info.status == "RUNNING"
        assert spool_files(spool_dir(tmp_path)) == [tracker.spool.path]
        with pytest.raises(MlflowException, match="Connection refused"):  # still down: nothing sent, spool kept
            replay_spool(spool_dir(tmp_path))
        with pytest.raises(SystemExit) as refused:  # the same through the CLI: one line, exit status 2
            main(["tracking", "replay", "--home", str(tmp_path)])
        assert refused.value.code == 2
        assert "sao: tracking replay: the MLflow server did not take a record" in capsys.readouterr().err
        proxy.start()
        assert main(["tracking", "replay", "--home", str(tmp_path)]) == 0
        assert "4 record(s) delivered" in capsys.readouterr().out  # steps 4, 5, 6 and the terminate
        assert replay_spool(spool_dir(tmp_path)) == 0
    assert close_s < 5
    assert _steps(client, tracker.run_id, "policy/loss") == [1, 2, 3, 4, 5, 6]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert spool_files(spool_dir(tmp_path)) == []


def test_replay_does_not_resend_a_batch_the_dead_writer_had_delivered(mlflow_server, tmp_path):
    """A process killed between a log_batch and the bookkeeping that records it: the replay finds the batch in
    the run's history and skips it (the offset said it was pending)."""
    from mlflow.tracking import MlflowClient

    with FaultProxy(mlflow_server) as proxy:
        tracker = _tracker(proxy, tmp_path, "crash")
        for step in (1, 2, 3):
            tracker.log_metrics({"policy/loss": float(step)}, step)
        proxy.stop()
        tracker.log_metrics({"policy/loss": 4.0}, 4)  # never delivered
        tracker.courier.drain(2)  # the process dies here (no terminate; closing the file releases the lock)...
        tracker.spool.mark(2)  # ...and it had delivered step 3 but not yet written that down
        tracker.spool.close()
        # The replay goes to the server directly (tracking_uri overrides the proxy's URI in the spool).
        assert replay_spool(spool_dir(tmp_path), tracking_uri=mlflow_server) == 1  # step 4; step 3 was found
    steps = [m.step for m in MlflowClient(mlflow_server).get_metric_history(tracker.run_id, "policy/loss")]
    assert Counter(steps) == {1: 1, 2: 1, 3: 1, 4: 1}


def test_a_record_the_server_refuses_is_kept_aside_and_delivery_goes_on(tmp_path):
    # MLflow refuses to change a logged param (400 INVALID_PARAMETER_VALUE): retrying cannot help, so the record
    # goes to <run>.rejected.jsonl with the reason, and the records after it are delivered.
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "sao", "run", "L", spool_dir=spool_dir(tmp_path))
    tracker.log_params({"lr": 1})
    tracker.log_params({"lr": 2})
    tracker.log_metrics({"policy/loss": 0.5}, 1)
    tracker.close()
    rejected = [json.loads(line) for line in tracker.spool.path.with_suffix(".rejected.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["params"]) for r in rejected] == [(2, {"lr": "2"})] and "lr" in rejected[0]["error"]
    assert _steps(tracker.client, tracker.run_id, "policy/loss") == [1]
    assert tracker.client.get_run(tracker.run_id).data.params == {"lr": "1"}


def test_rewind_during_an_outage_is_applied_in_order_when_the_server_returns(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    with FaultProxy(mlflow_server) as proxy:
        crashed = _tracker(proxy, tmp_path, "rewind")  # killed after step 5, its checkpoint at step 3
        for step in range(1, 6):
            crashed.log_metrics({"policy/loss": float(step)}, step)
        resumed = _tracker(proxy, tmp_path, "rewind")
        proxy.stop()
        started = time.monotonic()
        resumed.rewind(3)
        resumed.log_params({"resumed_at": 3})
        for step in (4, 5, 6):
            resumed.log_metrics({"policy/loss": 10.0 + step}, step)
        calls_s = time.monotonic() - started
        proxy.start()
        resumed.close()
    client = MlflowClient(mlflow_server)
    history = [(m.step, m.value) for m in client.get_metric_history(resumed.run_id, "policy/loss")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
    assert client.get_run(crashed.run_id).info.status == "KILLED"
    assert client.get_run(resumed.run_id).data.tags["sao.resumed_from_run"] == crashed.run_id
    assert calls_s < 5

"""The MLflow run's outbox: every tracker call is appended to a spool file on disk, then delivered in order by a
background thread (`Courier`), so a tracking server that goes away costs the run nothing but delay.

Spool file `<dir>/<run_id>.jsonl`: a header line {"run_id", "uri", "experiment_id", "lineage"}, then one record
per call, {"seq": 1, 2, ..., "op": "metrics" | "params" | "dataset" | "artifact" | "rewind" | "terminate", ...}, appended and flushed
before the call returns. `<run_id>.delivered` holds the seq of the last delivered record (written atomically
after each delivery); `<run_id>.rejected.jsonl` keeps records the server refused for good (a 4xx), with the
reason. Once every record is delivered and no tracker holds the spool, it is removed.

Delivery semantics. MLflow's log_batch is not idempotent, and a request that failed may still have been
applied (the answer was lost, or the process died before recording it). So a metrics record is sent as it is,
except when its outcome is in doubt: the first record after a failed request, and the first record a replay
sends. Then each of its log_batch chunks is first looked up in the run's history (the first metric of the
chunk at its step with its exact timestamp, both fixed when the record was spooled) and skipped when present.
With one request in flight at a time, at most one chunk is ever in doubt, so every point lands exactly once.
Params, dataset inputs and artifacts are idempotent in MLflow (re-logging an equal value is accepted, a dataset
is one input per digest, an artifact upload replaces the file); `rewind` skips the points the run already has;
terminating twice is harmless.

A live tracker holds an exclusive lock (flock) on its spool file, so `replay_spool` never delivers a spool its
writer is still delivering; the lock dies with the process.
"""

from __future__ import annotations

import fcntl
import json
import logging
import random
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from components.storage.local import write_json

logger = logging.getLogger("sao.tracking")

LINEAGE_TAG = "sao.lineage"


class Spool:
    """One MLflow run's records on disk, with the offset of the last one delivered."""

    def __init__(self, path: Path, header: dict | None = None) -> None:
        """Open the spool at `path`: a new one when `header` is given, else an existing one (ValueError when its
        header is missing)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a+")
        if header is not None:
            self._write(header)
        self._file.seek(0)
        lines = [json.loads(line) for line in self._file.read().splitlines() if line.strip()]
        if not lines or "run_id" not in lines[0]:
            raise ValueError(f"{self.path}: not an MLflow spool (no header line with a run_id)")
        self.header, self.records = lines[0], lines[1:]
        """The records in memory, trimmed as they are delivered (the disk keeps them all), so memory does not grow."""
        self.last_seq = self.records[-1]["seq"] if self.records else 0
        self._file.seek(0, 2)

    @property
    def run_id(self) -> str:
        return self.header["run_id"]

    @property
    def _offset_path(self) -> Path:
        return self.path.with_suffix(".delivered")

    def lock(self, wait: bool = False) -> bool:
        """Take the spool's exclusive lock; False when another open spool holds it (and `wait` is False)."""
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            return False

    def append(self, op: dict) -> dict:
        self.last_seq += 1
        record = {"seq": self.last_seq, **op}
        self._write(record)
        self.records.append(record)
        return record

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def delivered(self) -> int:
        """Seq of the last delivered record (0: none yet)."""
        return json.loads(self._offset_path.read_text())["seq"] if self._offset_path.exists() else 0

    def pending(self) -> list[dict]:
        done = self.delivered()
        return [r for r in self.records if r["seq"] > done]

    def mark(self, seq: int) -> None:
        write_json(self._offset_path, {"seq": seq})
        done = 0
        while done < len(self.records) and self.records[done]["seq"] <= seq:
            done += 1
        del self.records[:done]  # in place: an append from the logging thread is never lost

    def reject(self, record: dict, exc: Exception) -> None:
        """Keep a record the server refused for good, with the reason, beside the spool."""
        with self.path.with_suffix(".rejected.jsonl").open("a") as out:
            out.write(json.dumps({**record, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        logger.warning(
            "MLflow refused %s record %d of run %s (kept in %s): %s",
            record["op"],
            record["seq"],
            self.run_id,
            self.path.with_suffix(".rejected.jsonl"),
            exc,
        )

    def close(self, remove: bool = False) -> None:
        """Close (releasing the lock); `remove` (by the lock's holder) deletes the spool and its offset when
        every record was delivered."""
        if remove and not self.pending():
            self.path.unlink(missing_ok=True)
            self._offset_path.unlink(missing_ok=True)
        self._file.close()


def permanent(exc: Exception) -> bool:
    """True when the server refused the request for good (a 4xx other than 429): retrying cannot help."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    status = exc.get_http_status_code()
    return 400 <= status < 500 and status != 429


def deliver(client: Any, header: dict, record: dict, in_doubt: bool) -> bool:
    """Apply one spooled record to the run; `in_doubt`: a previous try may have been applied (see module doc).
    False when it had been: every chunk was found in the run's history and nothing was sent."""
    from mlflow.entities import Metric, Param

    run_id, op = header["run_id"], record["op"]
    if op == "metrics":
        points = [Metric(k, v, record["time_ms"], record["step"]) for k, v in record["metrics"].items()]
        sent = False
        for chunk in chunks(points, 1000):
            if not (in_doubt and _present(client, run_id, chunk[0])):
                client.log_batch(run_id, metrics=chunk)
                sent = True
        return sent
    if op == "params":
        for chunk in chunks([Param(k, v) for k, v in record["params"].items()], 100):
            client.log_batch(run_id, params=chunk)
    elif op == "dataset":  # MLflow keeps one input per dataset digest and run: a repeat changes nothing
        from mlflow.entities import Dataset, DatasetInput, InputTag

        tag = InputTag("mlflow.data.context", record["context"])
        client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**record["dataset"]), tags=[tag])])
    elif op == "artifact":  # an upload to the same path replaces it
        client.log_artifact(run_id, record["path"])
    elif op == "rewind":
        rewind_run(client, header, record["step"])
    elif op == "terminate":
        client.set_terminated(run_id, record["status"])
    else:
        raise ValueError(f"spool record {record['seq']} of run {run_id}: unknown op {op!r}")
    return True


def _present(client: Any, run_id: str, point: Any) -> bool:
    return any(
        m.step == point.step and m.timestamp == point.timestamp for m in client.get_metric_history(run_id, point.key)
    )


def previous_run(client: Any, header: dict) -> Any:
    """The newest other run of the spool's lineage, or None."""
    runs = client.search_runs(
        [header["experiment_id"]],
        filter_string=f"tags.`{LINEAGE_TAG}` = '{header['lineage']}'",
        order_by=["attributes.start_time DESC"],
        max_results=10,
    )
    return next((r for r in runs if r.info.run_id != header["run_id"]), None)


def rewind_run(client: Any, header: dict, step: int) -> None:
    """Copy the previous run's history up to `step` into this run (the points this run lacks), tag both, and
    mark the previous one KILLED if it never said how it ended."""
    from mlflow.entities import Metric

    previous = previous_run(client, header)
    if previous is None:
        return
    run_id, prev_id = header["run_id"], previous.info.run_id
    have = {(key, m.step) for key in previous.data.metrics for m in client.get_metric_history(run_id, key)}
    points = [
        Metric(m.key, m.value, m.timestamp, m.step)
        for key in previous.data.metrics
        for m in client.get_metric_history(prev_id, key)
        if m.step <= step and (m.key, m.step) not in have
    ]
    for chunk in chunks(points, 1000):
        client.log_batch(run_id, metrics=chunk)
    client.set_tag(run_id, "sao.resumed_from_run", prev_id)
    client.set_tag(run_id, "sao.resumed_at_step", str(step))
    client.set_tag(prev_id, "sao.superseded_by_run", run_id)
    if previous.info.status == "RUNNING":  # killed without a chance to say so
        client.set_terminated(prev_id, "KILLED")


def chunks(items: list, size: int) -> list[list]:
    """MLflow's log_batch takes at most 1000 metrics and 100 params per call."""
    return [items[i : i + size] for i in range(0, len(items), size)]


class Courier:
    """Delivers a spool's records in order on a daemon thread, one request at a time. A failed request is
    retried with exponential backoff and jitter (0.25 s doubling to `retry_max_s`) until it succeeds; `healthy`
    says whether the last request did."""

    def __init__(self, client: Any, spool: Spool, retry_max_s: float = 10.0) -> None:
        self.client, self.spool, self.retry_max_s = client, spool, retry_max_s
        self.healthy = True
        self.delivered_seq = spool.delivered()
        self._queue = deque(spool.pending())
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"mlflow-courier-{spool.run_id[:8]}")
        self._thread.start()

    def submit(self, record: dict, wait_s: float) -> None:
        """Queue a spooled record; wait up to `wait_s` for its delivery while the server is answering."""
        with self._cond:
            self._queue.append(record)
            self._cond.notify_all()
            if self.healthy and wait_s > 0:
                self._cond.wait_for(lambda: self.delivered_seq >= record["seq"] or not self.healthy, wait_s)

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the queue to empty, then stop the thread after its current request (waiting
        for that at most the rest of `timeout_s`, and 1 s); returns how many records are still undelivered."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.wait_for(lambda: not self._queue, timeout_s)
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        with self._cond:
            return len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        failures, in_doubt = 0, bool(self._queue)  # a reopened spool's first record may have been sent already
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                record = self._queue[0]
            try:
                deliver(self.client, self.spool.header, record, in_doubt)
            except Exception as exc:  # noqa: BLE001 - every failure is either retried or kept on disk
                if permanent(exc):
                    self.spool.reject(record, exc)
                else:
                    failures, in_doubt = failures + 1, True
                    if failures == 1:
                        logger.warning(
                            "MLflow unreachable, metrics stay spooled in %s until it returns: %s", self.spool.path, exc
                        )
                    with self._cond:
                        self.healthy = False
                        self._cond.notify_all()
                        ceiling = min(0.25 * 2 ** (failures - 1), self.retry_max_s)
                        self._cond.wait_for(lambda: self._stopping, random.uniform(ceiling / 2, ceiling))
                    continue
            self.spool.mark(record["seq"])
            if failures:
                logger.warning(
                    "MLflow reachable again after %d failed requests; delivering %s", failures, self.spool.path
                )
            failures, in_doubt = 0, False
            with self._cond:
                self._queue.popleft()
                self.delivered_seq, self.healthy = record["seq"], True
                self._cond.notify_all()


SPOOL_DIR = "mlflow-spool"
"""The spools' directory under a run home."""


def spool_files(path: str | Path) -> list[Path]:
    """The spool files at `path`: the file itself, the `*.jsonl` spools in a directory, or those of a run home
    (`<home>/mlflow-spool`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if (path / SPOOL_DIR).is_dir():
        path = path / SPOOL_DIR
    return sorted(p for p in path.glob("*.jsonl") if not p.name.endswith(".rejected.jsonl"))


def replay_spool(path: str | Path, tracking_uri: str | None = None, quiet: bool = False) -> int:
    """Deliver what the spools at `path` (a spool file, a spool directory or a run home) still hold, in order,
    to the URI recorded in each spool (or `tracking_uri`); returns the number of records sent (one found
    already in the run, sent by a writer that died before recording it, is not sent again). A spool whose
    writer is still alive (its lock is held) is skipped; a fully delivered one is removed, so replaying again
    sends nothing. Raises the first transport error (nothing after it is sent; run it again later)."""
    from mlflow.tracking import MlflowClient

    delivered = 0
    for file in spool_files(path):
        spool = Spool(file)
        try:
            if not spool.lock():
                if not quiet:  # a tracker starting beside live ones (a pipeline's stages) expects them
                    logger.warning("%s: its tracker is still running; not replaying it", file)
                continue
            client = MlflowClient(tracking_uri or spool.header["uri"])
            for i, record in enumerate(spool.pending()):
                try:
                    delivered += deliver(client, spool.header, record, in_doubt=i == 0)
                except Exception as exc:
                    if not permanent(exc):
                        raise
                    spool.reject(record, exc)
                spool.mark(record["seq"])
        finally:
            spool.close(remove=True)
    return delivered

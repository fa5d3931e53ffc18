"""S3 endpoint faults during publish and download: moto's real S3 server behind `tests/faultproxy.FaultProxy`,
which answers 5xx, holds answers past the client's read timeout, resets connections or stops listening.

What must hold: transient failures are retried (the proxy sees each failed request again) and the artifact
round-trips intact; an outage longer than the retry budget fails with a StoreError naming the object and the
endpoint's error, leaves nothing marked complete, and is not taken for a damaged checkpoint on resume.
"""

import os
import re
import time
import uuid

import pytest
import torch

from components.storage import StoreError, open_store
from components.training.rl.checkpoint import CheckpointStore
from tests.faultproxy import FaultProxy

MIB = 1024 * 1024

INTERNAL_ERROR = b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"


@pytest.fixture
def proxy(s3_env, monkeypatch):
    """A fault proxy in front of the session's moto server; the S3 clients made in the test talk to it."""
    with FaultProxy(s3_env) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


def _store(**options):
    """A store on a fresh bucket with fast test backoff (`options` override), the bucket made before any fault."""
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    settings = {
        "multipart_threshold": 5 * MIB,
        "multipart_chunksize": 5 * MIB,
        "backoff_s": 0.05,
        "max_backoff_s": 0.4,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 2.0,
        **options,
    }
    store = open_store(f"s3://{bucket}/runs", **settings)
    store.client.create_bucket(Bucket=bucket)
    return store


def _write(root, files):
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _read(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _unanswered_then_retried(proxy) -> list[tuple[str, str]]:
    """(method, path) of every request the proxy failed, each checked to have been sent again and answered (a
    multipart part counts as sent again in a new upload of the same file: its uploadId is ignored)."""
    log = [(m, re.sub(r"uploadId=[^&]*&?", "", p), outcome) for m, p, outcome in proxy.log]
    failed = [(i, m, p) for i, (m, p, outcome) in enumerate(log) if outcome != "forwarded"]
    for i, method, path in failed:
        assert (method, path, "forwarded") in log[i + 1 :], f"{method} {path} failed at the proxy, never retried"
    return [(m, p) for _, m, p in failed]


@pytest.mark.parametrize("retries", [0, 4], ids=["store-retries", "botocore-retries"])
def test_5xx_bursts_during_multipart_publish_and_download_are_retried(proxy, tmp_path, retries):
    # retries=0: botocore gives up at once and the store's own retry loop is what recovers (for the multipart
    # file: the whole file again); retries=4: botocore retries each failed request itself. Either way the
    # proxy must see every failed request again, answered.
    store = _store(retries=retries, attempts=5)
    files = {"policy.pt": os.urandom(11 * MIB), "state.pt": os.urandom(3000)}  # 11 MiB: 3 multipart parts
    proxy.reset_stats()
    proxy.mode("5xx", count=3, match="partNumber=")  # 503 SlowDown for three UploadPart requests
    store.put_dir(_write(tmp_path / "src", files), "ckpt/step-00000001")
    assert proxy.stats()["failed"] == 3 and len(_unanswered_then_retried(proxy)) == 3
    # Two of the three ranged GETs of the download answer 500 InternalError.
    proxy.reset_stats()
    proxy.mode(
        "5xx",
        count=2,
        match="GET /" + f"{store.bucket}/runs/ckpt/step-00000001/policy.pt",
        status=500,
        body=INTERNAL_ERROR,
    )
    out = store.get_dir("ckpt/step-00000001", tmp_path / "out")
    assert proxy.stats()["failed"] == 2 and len(_unanswered_then_retried(proxy)) == 2
    assert _read(out) == files


def test_answers_slower_than_the_read_timeout_are_retried_and_a_hung_endpoint_is_bounded(proxy, tmp_path):
    store = _store(retries=0, attempts=4, read_timeout_s=0.5)
    files = {"a.pt": os.urandom(5000), "b.pt": os.urandom(7000)}
    proxy.reset_stats()
    proxy.mode("slow", count=2, delay_s=1.5)  # each held 1.5 s > the 0.5 s read timeout: the client gives up
    store.put_dir(_write(tmp_path / "src", files), "k")
    proxy.mode("slow", count=2, delay_s=1.5)
    assert _read(store.get_dir("k", tmp_path / "out")) == files
    slow = [(m, p) for m, p, outcome in proxy.log if outcome == "slow"]
    assert len(slow) == 4 and all((m, p, "forwarded") in proxy.log for m, p in slow)  # each one asked again
    # An endpoint that never answers in time: 4 tries of 0.5 s plus backoff, then a StoreError naming the object.
    proxy.mode("slow", delay_s=30)
    started = time.monotonic()
    with pytest.raises(StoreError, match=rf"s3://{store.bucket}/runs/k/_COMPLETE: failed 4 times.*[Tt]imeout"):
        store.is_complete("k")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("fault", ["down", "stopped"])
def test_outage_longer_than_the_retry_budget_fails_the_publish_and_marks_nothing(proxy, tmp_path, fault):
    store = _store(retries=1, attempts=3)
    src = _write(tmp_path / "src", {"policy.pt": os.urandom(4000)})
    store.put_dir(src, "ckpt/step-00000001")
    if fault == "down":
        proxy.mode("down")  # connections reset after the request is read
    else:
        proxy.stop()  # nothing listens: connection refused
    key = "ckpt/step-00000002"
    endpoint_error = "Connection was closed" if fault == "down" else "Could not connect to the endpoint URL"
    with pytest.raises(StoreError, match=rf"s3://{store.bucket}/runs/{key}.*{endpoint_error}"):
        store.put_dir(src, key)
    if fault == "stopped":
        proxy.start()
    proxy.mode("pass")
    assert not store.is_complete(key) and store.list_complete("ckpt") == ["step-00000001"]
    store.put_dir(src, key)  # the endpoint is back: the same publish now goes through
    assert store.list_complete("ckpt") == ["step-00000001", "step-00000002"]
    assert _read(store.get_dir(key, tmp_path / "out")) == _read(src)


def test_endpoint_stopped_for_a_while_mid_publish_and_mid_download_is_ridden_out(proxy, tmp_path):
    # The default per-request retries, and a store budget (8 tries, 0.2 s doubling to 1 s: >= 2.9 s of
    # backoff) longer than the 1.5 s the endpoint stays away.
    store = _store(attempts=8, backoff_s=0.2, max_backoff_s=1.0)
    files = {f"shard-{i}.pt": os.urandom(200_000) for i in range(6)}
    src = _write(tmp_path / "src", files)

    proxy.stop_after(4, for_s=1.5)  # after the marker delete, the listing and two shards
    started = time.monotonic()
    store.put_dir(src, "k")
    publish_s = time.monotonic() - started
    proxy.stop_after(4, for_s=1.5)
    started = time.monotonic()
    assert _read(store.get_dir("k", tmp_path / "out")) == files
    download_s = time.monotonic() - started
    assert publish_s >= 1.4 and download_s >= 1.4  # both waited the outage out (and took no shortcut)
    print(f"publish {publish_s:.2f} s, download {download_s:.2f} s across a 1.5 s outage")


def test_download_outage_on_resume_is_an_error_not_a_damaged_checkpoint(proxy, tmp_path):
    store = _store(retries=1, attempts=3)
    ckpt = CheckpointStore(store, "checkpoints/tiny", tmp_path / "cache")
    for step in (1, 2):
        ckpt.save(step, {"policy": {"w": torch.full((3,), float(step))}})
    # Down past the budget: the newest checkpoint is not skipped as if it were damaged, and nothing is deleted.
    proxy.mode("down")
    log: list[str] = []
    with pytest.raises(StoreError, match=rf"s3://{store.bucket}/runs/checkpoints/tiny"):
        ckpt.load_latest(log.append)
    assert log == []
    proxy.mode("pass")
    assert ckpt.steps() == [1, 2]
    # Down for a few requests only: retried, and the newest checkpoint loads.
    proxy.reset_stats()
    proxy.mode("down", count=3)
    step, payload = ckpt.load_latest(log.append)
    assert step == 2 and torch.equal(payload["policy"]["w"], torch.full((3,), 2.0)) and log == []
    assert proxy.stats()["failed"] == 3 and len(_unanswered_then_retried(proxy)) == 3

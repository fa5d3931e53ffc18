"""`S3Store`: artifacts in an S3 bucket, or any S3-compatible store (MinIO, moto, ...). The only module here that
imports boto3; `open_store` imports it for `s3://` URIs alone.

The endpoint comes from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` when set, credentials from the usual boto3
chain. Files go through boto3's transfer manager (multipart above `multipart_threshold`). Layout and order are
those of `LocalStore`: the files, then `manifest.json`, then `_COMPLETE`; S3 has no rename, so the marker alone
says an artifact is whole.

Failures are retried at two levels. botocore's "standard" mode retries each request (connection errors, read
timeouts, 5xx, throttling) `retries` times with a short backoff (50 ms base, 1 s for throttling), which rides out
a blip; but its retries share a client-wide quota and add up to seconds, not the minute an endpoint restart
takes. So each idempotent unit of work (one file up or down, the manifest, the marker, a listing, a delete) is
also retried by the store, `attempts` times with exponential backoff and jitter (`backoff_s` doubling up to
`max_backoff_s`), on transient failures only: a 4xx such as NoSuchBucket or AccessDenied fails at once. Every
request is bounded by `connect_timeout_s` / `read_timeout_s`, so a hung endpoint costs a retry, never the run.

`threads` files are hashed and uploaded (or downloaded and verified) at once, each through the transfer manager's
own part threads; boto3's client is thread-safe, and its connection pool is sized for all of them."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import boto3
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    ResponseStreamingError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

from components.faults import fault_point
from components.storage.artifacts import (
    MANIFEST,
    STORE_THREADS,
    CorruptArtifact,
    IncompleteArtifact,
    StoreError,
    check_key,
    check_threads,
    file_meta,
    join,
    manifest_bytes,
    manifest_entries,
    run_all,
    source_files,
    verify,
)
from components.storage.local import MARKER, atomic_fill

T = TypeVar("T")

MIN_PART = 5 * 1024 * 1024
"""S3's smallest multipart part (every part but the last)."""

_MISSING = ("404", "NoSuchKey", "NotFound")

_TRANSIENT_CODES = (
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
)
"""S3 error codes that say "try again" (besides any 5xx status)."""

_TRANSIENT_EXCEPTIONS = (
    BotoConnectionError,
    HTTPClientError,
    ResponseStreamingError,
    IncompleteReadError,
    RetriesExceededError,
    TransferRetriesExceeded,
    socket.timeout,
    ConnectionError,
)
"""Transport failures: refused or reset connections, timeouts, a body cut short, the transfer manager's own
download retries exhausted."""


def _missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code", "") in _MISSING


def transient(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps (boto3's S3UploadFailedError wraps the ClientError), is worth
    retrying: a transport failure, a 5xx or a throttling answer."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _TRANSIENT_EXCEPTIONS):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return status >= 500 or exc.response.get("Error", {}).get("Code", "") in _TRANSIENT_CODES
        exc = exc.__cause__ or exc.__context__
    return False


class S3Store:
    """Artifacts as objects `s3://<bucket>/<prefix>/<key>/{files..., manifest.json, _COMPLETE}`."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 64 * 1024 * 1024,
        retries: int = 4,
        attempts: int = 6,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        threads: int = STORE_THREADS,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"S3Store bucket must be a bucket name, got {bucket!r}")
        if multipart_chunksize < MIN_PART:
            raise ValueError(
                f"S3Store multipart_chunksize must be >= {MIN_PART} (S3's smallest part), got {multipart_chunksize}"
            )
        if multipart_threshold < 1:
            raise ValueError(f"S3Store multipart_threshold must be >= 1, got {multipart_threshold}")
        if retries < 0:
            raise ValueError(f"S3Store retries must be >= 0, got {retries}")
        if attempts < 1:
            raise ValueError(f"S3Store attempts must be >= 1, got {attempts}")
        if not 0 <= backoff_s <= max_backoff_s <= 600:
            raise ValueError(
                f"S3Store backoff must satisfy 0 <= backoff_s <= max_backoff_s <= 600, got "
                f"backoff_s={backoff_s}, max_backoff_s={max_backoff_s}"
            )
        for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s)):
            if not 0 < value <= 3600:
                raise ValueError(f"S3Store {name} must be in (0, 3600] seconds, got {value}")
        self.threads = check_threads(threads, "S3Store")
        """Files hashed and moved at once (each in `transfer.max_concurrency` parts at once when multipart)."""
        self.bucket = bucket
        """Bucket holding the artifacts."""
        self.prefix = check_key(prefix, allow_empty=True)
        """Key prefix inside the bucket that every artifact key is relative to ('' for the bucket's root)."""
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)
        """boto3 transfer-manager settings for uploads and downloads (files above the threshold go multipart)."""
        self.attempts, self.backoff_s, self.max_backoff_s = attempts, backoff_s, max_backoff_s
        """Store-level tries of each unit of work on transient failures, and the backoff between them: attempt
        i+1 waits uniformly in [d/2, d], d = min(backoff_s * 2**i, max_backoff_s). The defaults (6 tries, 1 s
        doubling) wait 15.5-31 s in all before giving up, on top of botocore's own retries."""
        self.jitter = random.Random()
        """The backoff's own generator: an upload on a checkpoint's thread leaves the run's `random` state (saved in
        every checkpoint) alone."""
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        # botocore's "max_attempts" counts retries after the first try (it keeps retries + 1 as the total).
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(
                retries={"max_attempts": retries, "mode": "standard"},
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                max_pool_connections=self.threads * self.transfer.max_concurrency,
            ),
        )
        """The boto3 S3 client: endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, `retries` retries of
        throttled and transient failures per request in botocore's "standard" mode, and every request bounded
        by `connect_timeout_s` and `read_timeout_s` (a read timeout is one more transient failure); a connection
        for each part in flight of `threads` files."""

    @classmethod
    def from_uri(cls, uri: str, **options) -> S3Store:
        """`s3://bucket[/prefix]` -> a store; ValueError naming the URI when the bucket is missing."""
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"s3 store URI must be s3://bucket[/prefix], got {uri!r}")
        return cls(bucket, prefix, **options)

    def _key(self, key: str, allow_empty: bool = False) -> str:
        return join(self.prefix, check_key(key, allow_empty))

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(key, allow_empty=True)}"

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """S3 and transfer failures (after all retries) as StoreError naming the artifact."""
        try:
            yield
        except (ClientError, BotoCoreError, S3UploadFailedError, RetriesExceededError, TransferRetriesExceeded) as exc:
            raise StoreError(f"{self.uri(key)}: {exc}") from exc

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """`call()` (an idempotent unit of work on object `what`), tried up to `attempts` times while it fails
        transiently; the last failure is raised with the object and the number of tries in its message."""
        failures = 0
        while True:
            try:
                return call()
            except Exception as exc:
                failures += 1
                if not transient(exc):
                    raise
                if failures == self.attempts:
                    raise StoreError(
                        f"s3://{self.bucket}/{what}: failed {failures} times, last: {type(exc).__name__}: {exc}"
                    ) from exc
                ceiling = min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)
                time.sleep(self.jitter.uniform(ceiling / 2, ceiling))

    def _get(self, object_key: str) -> bytes | None:
        def get() -> bytes | None:  # the body is read inside the retry: a stream cut short is retried too
            try:
                return self.client.get_object(Bucket=self.bucket, Key=object_key)["Body"].read()
            except ClientError as exc:
                if _missing(exc):
                    return None
                raise

        return self._retry(object_key, get)

    def read_object(self, key: str) -> bytes | None:
        """The bytes of one object `key` under the prefix (a file, not an artifact: no manifest), retried like
        every read; None when it does not exist."""
        with self._errors(key):
            return self._get(self._key(key))

    def _put(self, object_key: str, body: bytes) -> None:
        self._retry(object_key, lambda: self.client.put_object(Bucket=self.bucket, Key=object_key, Body=body))

    def put_dir(self, local_dir: Path, key: str) -> str:
        base, files = self._key(key), source_files(local_dir)
        with self._errors(key):
            self.delete(key)  # the old marker goes first: a half-replaced artifact is never complete

            def upload(path: Path, rel: str) -> dict:
                meta = file_meta(path)
                self._retry(
                    f"{base}/{rel}",
                    lambda: self.client.upload_file(str(path), self.bucket, f"{base}/{rel}", Config=self.transfer),
                )
                fault_point("store.upload")
                return meta

            metas = run_all([lambda p=path, r=rel: upload(p, r) for rel, path in files], self.threads)
            manifest = {rel: meta for (rel, _), meta in zip(files, metas)}
            self._put(f"{base}/{MANIFEST}", manifest_bytes(check_key(key), manifest))
            self._put(f"{base}/{MARKER}", json.dumps({"completed_at": time.time()}).encode())
        return self.uri(key)

    def get_dir(self, key: str, local_dir: Path) -> Path:
        base, uri = self._key(key), self.uri(key)
        with self._errors(key):
            if not self.is_complete(key):
                raise IncompleteArtifact(f"{uri}: not a complete artifact (no {MARKER} marker)")
            entries = manifest_entries(uri, self._get(f"{base}/{MANIFEST}"))
            with atomic_fill(local_dir) as tmp:

                def download(rel: str, expected: dict) -> None:
                    dst = tmp / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        self._retry(
                            f"{base}/{rel}",
                            lambda: self.client.download_file(
                                self.bucket, f"{base}/{rel}", str(dst), Config=self.transfer
                            ),
                        )
                    except ClientError as exc:
                        if _missing(exc):
                            raise CorruptArtifact(f"{uri}/{rel} is listed in its manifest but missing") from exc
                        raise
                    verify(uri, rel, expected, file_meta(dst))

                run_all([lambda r=rel, e=expected: download(r, e) for rel, expected in entries], self.threads)
        return Path(local_dir)

    def is_complete(self, key: str) -> bool:
        with self._errors(key):
            marker = f"{self._key(key)}/{MARKER}"
            try:
                self._retry(marker, lambda: self.client.head_object(Bucket=self.bucket, Key=marker))
            except ClientError as exc:
                if _missing(exc):
                    return False
                raise
        return True

    def _list(self, start: str) -> list[str]:
        def listing() -> list[str]:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
            return [entry["Key"] for page in pages for entry in page.get("Contents", [])]

        return self._retry(start, listing)

    def list_complete(self, prefix: str = "") -> list[str]:
        base = self._key(prefix, allow_empty=True)
        start = f"{base}/" if base else ""
        names = set()
        with self._errors(prefix):
            for object_key in self._list(start):  # one listing instead of a HEAD per child
                parts = object_key[len(start) :].split("/")
                if len(parts) == 2 and parts[1] == MARKER:
                    names.add(parts[0])
        return sorted(names)

    def delete(self, key: str) -> None:
        base = self._key(key)
        with self._errors(key):
            self._retry(
                f"{base}/{MARKER}", lambda: self.client.delete_object(Bucket=self.bucket, Key=f"{base}/{MARKER}")
            )
            keys = self._list(f"{base}/")
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                result = self._retry(
                    f"{base}/",
                    lambda batch=batch: self.client.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                    ),
                )
                if result.get("Errors"):
                    error = result["Errors"][0]
                    raise StoreError(
                        f"{self.uri(key)}: could not delete {error.get('Key')}: "
                        f"{error.get('Code')} {error.get('Message')}"
                    )

"""`S3Store`: artifacts in an S3 bucket, or any S3-compatible store (MinIO, moto, ...). The only module here that
imports boto3; `open_store` imports it for `s3://` URIs alone.

The endpoint comes from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` when set, credentials from the usual boto3
chain. Files go through boto3's transfer manager (multipart above `multipart_threshold`), and botocore retries
throttling and transient errors in its "standard" mode. Layout and order are those of `LocalStore`: the files,
then `manifest.json`, then `_COMPLETE`; S3 has no rename, so the marker alone says an artifact is whole.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from components.storage.artifacts import (MANIFEST, CorruptArtifact, IncompleteArtifact, StoreError, check_key,
                                          file_meta, join, manifest_bytes, manifest_entries, source_files, verify)
from components.storage.local import MARKER, atomic_fill

MIN_PART = 5 * 1024 * 1024
"""S3's smallest multipart part (every part but the last)."""

_MISSING = ("404", "NoSuchKey", "NotFound")


def _missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code", "") in _MISSING


class S3Store:
    """Artifacts as objects `s3://<bucket>/<prefix>/<key>/{files..., manifest.json, _COMPLETE}`."""

    def __init__(self, bucket: str, prefix: str = "", *, multipart_threshold: int = 64 * 1024 * 1024,
                 multipart_chunksize: int = 64 * 1024 * 1024, retries: int = 10) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"S3Store bucket must be a bucket name, got {bucket!r}")
        if multipart_chunksize < MIN_PART:
            raise ValueError(f"S3Store multipart_chunksize must be >= {MIN_PART} (S3's smallest part), "
                             f"got {multipart_chunksize}")
        if multipart_threshold < 1:
            raise ValueError(f"S3Store multipart_threshold must be >= 1, got {multipart_threshold}")
        if retries < 0:
            raise ValueError(f"S3Store retries must be >= 0, got {retries}")
        self.bucket = bucket
        """Bucket holding the artifacts."""
        self.prefix = check_key(prefix, allow_empty=True)
        """Key prefix inside the bucket that every artifact key is relative to ('' for the bucket's root)."""
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=multipart_chunksize)
        """boto3 transfer-manager settings for uploads and downloads (files above the threshold go multipart)."""
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        # botocore's "max_attempts" counts retries after the first try (it keeps retries + 1 as the total).
        self.client = boto3.client("s3", endpoint_url=endpoint,
                                   config=Config(retries={"max_attempts": retries, "mode": "standard"}))
        """The boto3 S3 client: endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, `retries` retries of
        throttled and transient failures in botocore's "standard" mode (with backoff)."""

    @classmethod
    def from_uri(cls, uri: str, **options) -> S3Store:
        """`s3://bucket[/prefix]` -> a store; ValueError naming the URI when the bucket is missing."""
        if not uri.startswith("s3://"):
            raise ValueError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"s3 store URI must be s3://bucket[/prefix], got {uri!r}")
        return cls(bucket, prefix, **options)

    def _key(self, key: str, allow_empty: bool = False) -> str:
        return join(self.prefix, check_key(key, allow_empty))

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(key, allow_empty=True)}"

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """S3 and transfer failures (after botocore's retries) as StoreError naming the artifact."""
        try:
            yield
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            raise StoreError(f"{self.uri(key)}: {exc}") from exc

    def _get(self, object_key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=object_key)["Body"].read()
        except ClientError as exc:
            if _missing(exc):
                return None
            raise

    def put_dir(self, local_dir: Path, key: str) -> str:
        base, files = self._key(key), source_files(local_dir)
        with self._errors(key):
            self.delete(key)  # the old marker goes first: a half-replaced artifact is never complete
            manifest = {}
            for rel, path in files:
                manifest[rel] = file_meta(path)
                self.client.upload_file(str(path), self.bucket, f"{base}/{rel}", Config=self.transfer)
            self.client.put_object(Bucket=self.bucket, Key=f"{base}/{MANIFEST}",
                                   Body=manifest_bytes(check_key(key), manifest))
            self.client.put_object(Bucket=self.bucket, Key=f"{base}/{MARKER}",
                                   Body=json.dumps({"completed_at": time.time()}).encode())
        return self.uri(key)

    def get_dir(self, key: str, local_dir: Path) -> Path:
        base, uri = self._key(key), self.uri(key)
        with self._errors(key):
            if not self.is_complete(key):
                raise IncompleteArtifact(f"{uri}: not a complete artifact (no {MARKER} marker)")
            entries = manifest_entries(uri, self._get(f"{base}/{MANIFEST}"))
            with atomic_fill(local_dir) as tmp:
                for rel, expected in entries:
                    dst = tmp / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        self.client.download_file(self.bucket, f"{base}/{rel}", str(dst), Config=self.transfer)
                    except ClientError as exc:
                        if _missing(exc):
                            raise CorruptArtifact(f"{uri}: {rel} is listed in its manifest but missing") from exc
                        raise
                    verify(uri, rel, expected, file_meta(dst))
        return Path(local_dir)

    def is_complete(self, key: str) -> bool:
        with self._errors(key):
            try:
                self.client.head_object(Bucket=self.bucket, Key=f"{self._key(key)}/{MARKER}")
            except ClientError as exc:
                if _missing(exc):
                    return False
                raise
        return True

    def _list(self, start: str) -> Iterator[str]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for entry in page.get("Contents", []):
                yield entry["Key"]

    def list_complete(self, prefix: str = "") -> list[str]:
        base = self._key(prefix, allow_empty=True)
        start = f"{base}/" if base else ""
        names = set()
        with self._errors(prefix):
            for object_key in self._list(start):  # one listing instead of a HEAD per child
                parts = object_key[len(start):].split("/")
                if len(parts) == 2 and parts[1] == MARKER:
                    names.add(parts[0])
        return sorted(names)

    def delete(self, key: str) -> None:
        base = self._key(key)
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=f"{base}/{MARKER}")
            keys = list(self._list(f"{base}/"))
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": k} for k in keys[i:i + 1000]]
                result = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                if result.get("Errors"):
                    error = result["Errors"][0]
                    raise StoreError(f"{self.uri(key)}: could not delete {error.get('Key')}: "
                                     f"{error.get('Code')} {error.get('Message')}")

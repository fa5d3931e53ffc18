"""Which artifact store a URI names: a local tree (`LocalStore`) or S3 (`S3Store`, loaded only for `s3://`
URIs: it imports boto3). The one place that knows both, so neither store module imports the other."""

from __future__ import annotations

import os
from pathlib import Path

from components.storage.artifacts import ArtifactStore, LocalStore


def open_store(uri: str | Path, **s3_options) -> ArtifactStore:
    """The store at `uri`: a local path, or `s3://bucket[/prefix]` (options such as multipart sizes and
    retries go to `S3Store`)."""
    uri = str(uri)
    if not uri:
        raise ValueError("store uri must not be empty: give a local path or s3://bucket/prefix")
    if uri.startswith("s3://"):
        return _s3_store(uri).from_uri(uri, **s3_options)
    if "://" in uri:
        raise ValueError(f"store uri {uri!r}: unsupported scheme; give a local path or s3://bucket/prefix")
    if s3_options:
        raise ValueError(f"store uri {uri!r} is local; options {sorted(s3_options)} apply to s3:// stores only")
    return LocalStore(uri)


def resolve_store_uri(configured: str, home: Path) -> str:
    """Where artifacts go: `configured` (the config's store.uri) when set, else env SAO_STORE_URI, else the run
    home itself (so checkpoints stay at `<home>/checkpoints/<name>/step-XXXXXXXX`)."""
    if configured and configured.strip():
        return configured.strip()
    env = os.environ.get("SAO_STORE_URI", "").strip()
    return env or str(home)


def read_uri(uri: str) -> bytes:
    """The bytes of a local file or of one S3 object (`s3://bucket/key`, through `S3Store` with its retries and
    bounded timeouts); FileNotFoundError names the URI when it does not exist."""
    if not uri.startswith("s3://"):
        path = Path(uri)
        if not path.is_file():
            raise FileNotFoundError(f"not found: {uri}")
        return path.read_bytes()
    bucket, key = split_s3_uri(uri)
    data = _s3_store(uri)(bucket).read_object(key)
    if data is None:
        raise FileNotFoundError(f"not found: {uri}")
    return data


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> `("bucket", "some/key")`; ValueError when either part is missing."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise ValueError(f"s3 URI must be s3://bucket/key, got {uri!r}")
    return bucket, key


def _s3_store(uri: str) -> type:
    """`S3Store`, imported on first use; a clear error naming `uri` when boto3 is missing."""
    try:
        import boto3  # noqa: F401  (S3Store's dependency: checked here to name the URI that needs it)
    except ImportError as exc:
        raise ImportError(
            f"{uri} needs boto3, which is not installed in this environment; install it with `pip install boto3`"
        ) from exc
    from components.storage.s3 import S3Store  # it imports boto3: loaded for s3:// URIs only

    return S3Store

"""Storage: local run-home helpers (`local`), the artifact store over a local tree (`artifacts`) or S3 (`s3`), and
`open_store` (`stores`), which picks one by URI.

`components.storage.s3` imports boto3, so it is loaded only by `open_store` for `s3://` URIs.
"""

from components.storage.artifacts import (
    MANIFEST,
    ArtifactStore,
    CorruptArtifact,
    IncompleteArtifact,
    LocalStore,
    StoreError,
)
from components.storage.local import (
    MARKER,
    HomeStateError,
    atomic_dir,
    atomic_fill,
    is_complete,
    mark_complete,
    weights_fingerprint,
    write_json,
)
from components.storage.stores import open_store, read_uri, resolve_store_uri

__all__ = [
    "MANIFEST",
    "MARKER",
    "ArtifactStore",
    "CorruptArtifact",
    "HomeStateError",
    "IncompleteArtifact",
    "LocalStore",
    "StoreError",
    "atomic_dir",
    "atomic_fill",
    "is_complete",
    "mark_complete",
    "open_store",
    "read_uri",
    "resolve_store_uri",
    "weights_fingerprint",
    "write_json",
]

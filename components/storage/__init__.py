"""Storage: local run-home helpers (`local`) and the artifact store over a local tree or S3 (`artifacts`, `s3`).

`components.storage.s3` imports boto3, so it is loaded only by `open_store` for `s3://` URIs.
"""

from components.storage.artifacts import (MANIFEST, ArtifactStore, CorruptArtifact, IncompleteArtifact, LocalStore,
                                          StoreError, open_store, resolve_store_uri)
from components.storage.local import (MARKER, HomeStateError, atomic_dir, atomic_fill, is_complete,
                                      mark_complete, weights_fingerprint, write_json)

__all__ = [
    "MANIFEST", "MARKER", "ArtifactStore", "CorruptArtifact", "HomeStateError", "IncompleteArtifact", "LocalStore",
    "StoreError", "atomic_dir", "atomic_fill", "is_complete", "mark_complete", "open_store", "resolve_store_uri",
    "weights_fingerprint", "write_json",
]

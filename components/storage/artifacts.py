"""Artifacts: directories published whole under a key, in a local tree or an S3 bucket.

An artifact `<key>/` holds the published files, then `manifest.json` (sha256 and size of every file), then the
`_COMPLETE` marker, written in that order. Readers trust only keys with a marker and verify every file against
the manifest, so an interrupted upload is never taken for a whole artifact and a damaged one is never loaded.
Re-publishing a key removes its old marker before anything else changes.

`open_store(uri)` chooses the implementation: a local path gives `LocalStore`, `s3://bucket/prefix` gives
`S3Store` (components/storage/s3.py, which alone imports boto3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Protocol

from components.faults import fault_point
from components.storage.local import MARKER, atomic_dir, atomic_fill

MANIFEST = "manifest.json"
"""Name of the manifest inside every artifact: {"key": ..., "files": {relpath: {"sha256", "bytes"}}}."""

RESERVED = (MANIFEST, MARKER)
"""Top-level names an artifact's own files may not use."""

_CHUNK = 1 << 20


class StoreError(RuntimeError):
    """An artifact could not be read as published; the message names the artifact."""


class IncompleteArtifact(StoreError):
    """The key has no completion marker: never published, being published, or interrupted."""


class CorruptArtifact(StoreError):
    """A complete artifact whose content does not match its manifest; the message names the object
    (`<artifact uri>/<file>`)."""


class ArtifactStore(Protocol):
    """Where artifacts live. Keys are relative '/'-separated paths such as `checkpoints/tiny-cpu/step-00000004`."""

    def uri(self, key: str = "") -> str:
        """Printable location of `key` (of the store's root when empty), for messages."""
        ...

    def put_dir(self, local_dir: Path, key: str) -> str:
        """Publish `local_dir` (recursively) as the artifact `key`, replacing any old one; returns `uri(key)`."""
        ...

    def get_dir(self, key: str, local_dir: Path) -> Path:
        """Download and verify the artifact into `local_dir` (replaced atomically); returns `local_dir`."""
        ...

    def is_complete(self, key: str) -> bool:
        """True when `key` holds a completion marker."""
        ...

    def list_complete(self, prefix: str = "") -> list[str]:
        """Sorted names of the complete artifacts directly under `prefix`."""
        ...

    def delete(self, key: str) -> None:
        """Remove the artifact (its marker first); nothing happens when there is none."""
        ...


def check_key(key: str, allow_empty: bool = False) -> str:
    """`key` without surrounding slashes; ValueError naming it when it is empty, absolute or climbs out."""
    if not isinstance(key, str):
        raise ValueError(f"artifact key must be a string, got {type(key).__name__}")
    stripped = key.strip("/")
    if not stripped and not allow_empty:
        raise ValueError("artifact key must not be empty")
    parts = stripped.split("/") if stripped else []
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"artifact key {key!r} must be a relative path of plain names separated by '/'")
    return stripped


def join(*parts: str) -> str:
    """Non-empty parts joined with '/'."""
    return "/".join(p for p in parts if p)


def source_files(local_dir: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of every file under `local_dir`, sorted. A local completion marker (an
    `atomic_dir` artifact of the run home) is the source's own state, not content: it is skipped, and the
    store writes its own last. A top-level `manifest.json` is refused (the store's bookkeeping)."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise NotADirectoryError(f"cannot publish {local_dir}: not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(local_dir):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(local_dir).as_posix()
            if rel != MARKER:
                files.append((rel, path))
    for rel, _ in files:
        if rel in RESERVED:
            raise ValueError(f"cannot publish {local_dir}: {rel} is reserved for the store's own bookkeeping")
    return files


def file_meta(path: Path, copy_to: Path | None = None) -> dict:
    """{"sha256", "bytes"} of a file, read once in chunks; also copied to `copy_to` when given."""
    digest, size = hashlib.sha256(), 0
    out = None
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        out = open(copy_to, "wb")
    try:
        with open(path, "rb") as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                if out is not None:
                    out.write(chunk)
    finally:
        if out is not None:
            out.close()
    return {"sha256": digest.hexdigest(), "bytes": size}


def manifest_bytes(key: str, files: dict[str, dict]) -> bytes:
    return (json.dumps({"key": key, "files": files}, indent=2, sort_keys=True) + "\n").encode()


def manifest_entries(uri: str, data: bytes | None) -> list[tuple[str, dict]]:
    """The manifest's (relpath, meta) pairs; CorruptArtifact when it is missing, unreadable or names a path
    outside the artifact."""
    if data is None:
        raise CorruptArtifact(f"{uri}: has its {MARKER} marker but no {MANIFEST}")
    try:
        files = json.loads(data)["files"]
        entries = [(rel, {"sha256": str(m["sha256"]), "bytes": int(m["bytes"])}) for rel, m in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptArtifact(f"{uri}: {MANIFEST} is unreadable ({exc!r})") from exc
    for rel, _ in entries:
        parts = PurePosixPath(rel).parts
        if rel.startswith("/") or not parts or ".." in parts:
            raise CorruptArtifact(f"{uri}: {MANIFEST} names {rel!r}, a path outside the artifact")
    return sorted(entries)


def verify(uri: str, rel: str, expected: dict, actual: dict) -> None:
    """CorruptArtifact naming the object (`<artifact uri>/<file>`) when size or sha256 differ from the manifest."""
    if actual["bytes"] != expected["bytes"]:
        raise CorruptArtifact(f"{uri}/{rel} has {actual['bytes']} bytes, its manifest says {expected['bytes']}")
    if actual["sha256"] != expected["sha256"]:
        raise CorruptArtifact(
            f"{uri}/{rel} does not match its manifest sha256 (manifest {expected['sha256'][:16]}"
            f"..., stored {actual['sha256'][:16]}...)"
        )


class LocalStore:
    """Artifacts as directories under `root`: `root/<key>/{files..., manifest.json, _COMPLETE}`.

    Written into a temporary sibling and renamed into place, and only then marked (`atomic_dir`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        """Directory holding every key."""

    def _path(self, key: str, allow_empty: bool = False) -> Path:
        key = check_key(key, allow_empty)
        return self.root.joinpath(*key.split("/")) if key else self.root

    def uri(self, key: str = "") -> str:
        return str(self._path(key, allow_empty=True))

    def put_dir(self, local_dir: Path, key: str) -> str:
        target = self._path(key)
        files = source_files(local_dir)
        with atomic_dir(target) as tmp:
            manifest = {}
            for rel, path in files:
                manifest[rel] = file_meta(path, copy_to=tmp / rel)
                fault_point("store.upload")
            (tmp / MANIFEST).write_bytes(manifest_bytes(check_key(key), manifest))
        return str(target)

    def get_dir(self, key: str, local_dir: Path) -> Path:
        src, uri = self._path(key), self.uri(key)
        if not (src / MARKER).is_file():
            raise IncompleteArtifact(f"{uri}: not a complete artifact (no {MARKER} marker)")
        manifest = src / MANIFEST
        entries = manifest_entries(uri, manifest.read_bytes() if manifest.is_file() else None)
        with atomic_fill(local_dir) as tmp:
            for rel, expected in entries:
                path = src / rel
                if not path.is_file():
                    raise CorruptArtifact(f"{uri}/{rel} is listed in its manifest but missing")
                verify(uri, rel, expected, file_meta(path, copy_to=tmp / rel))
        return Path(local_dir)

    def is_complete(self, key: str) -> bool:
        return (self._path(key) / MARKER).is_file()

    def list_complete(self, prefix: str = "") -> list[str]:
        base = self._path(prefix, allow_empty=True)
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if (p / MARKER).is_file())

    def delete(self, key: str) -> None:
        path = self._path(key)
        if path.exists():
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)

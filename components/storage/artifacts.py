"""Artifacts: directories published whole under a key, in a local tree or an S3 bucket.

An artifact `<key>/` holds the published files, then `manifest.json` (sha256 and size of every file), then the
`_COMPLETE` marker, written in that order. Readers trust only keys with a marker and verify every file against
the manifest, so an interrupted upload is never taken for a whole artifact and a damaged one is never loaded.
Re-publishing a key removes its old marker before anything else changes.

Files are hashed (and copied or uploaded) by `threads` worker threads at once, each file read in 1 MiB chunks:
hashlib and file I/O release the GIL on such buffers, so a checkpoint of many per-rank shards is read at the
disk's speed rather than one core's sha256 speed (issue 42, item 10). The manifest is the same as a serial
publish's: each file's sha256 over its whole content.

`open_store(uri)` chooses the implementation: a local path gives `LocalStore`, `s3://bucket/prefix` gives
`S3Store` (components/storage/s3.py, which alone imports boto3).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path, PurePosixPath
from typing import Protocol, TypeVar

from components.faults import fault_point
from components.storage.local import MARKER, atomic_dir, atomic_fill

MANIFEST = "manifest.json"
"""Name of the manifest inside every artifact: {"key": ..., "files": {relpath: {"sha256", "bytes"}}}."""

RESERVED = (MANIFEST, MARKER)
"""Top-level names an artifact's own files may not use."""

_CHUNK = 1 << 20

STORE_THREADS = min(8, os.cpu_count() or 1)
"""Files a store hashes and moves at once by default: the cores, up to 8."""

T = TypeVar("T")


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


def check_threads(threads: int, store: str) -> int:
    """`threads` when it is an int >= 1; ValueError naming the store's `threads` otherwise."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{store} threads must be an integer >= 1, got {threads!r}")
    return threads


def run_all(tasks: list[Callable[[], T]], threads: int) -> list[T]:
    """Each task's result, in the tasks' order, run by up to `threads` worker threads. At the first failure the
    tasks not yet begun are cancelled, the running ones are let finish (nothing goes on reading or writing after
    this returns), and the failure of the first failed task in order is raised."""
    if threads <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="sao-store") as pool:
        futures = [pool.submit(task) for task in tasks]
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(_failed(f) for f in futures):
            for future in futures:
                future.cancel()
            wait(futures)
            raise next(f.exception() for f in futures if _failed(f))
        return [future.result() for future in futures]


def _failed(future: Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


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

    def __init__(self, root: str | Path, threads: int = STORE_THREADS) -> None:
        self.root = Path(root)
        """Directory holding every key."""
        self.threads = check_threads(threads, "LocalStore")
        """Files copied and hashed at once."""

    def _path(self, key: str, allow_empty: bool = False) -> Path:
        key = check_key(key, allow_empty)
        return self.root.joinpath(*key.split("/")) if key else self.root

    def uri(self, key: str = "") -> str:
        return str(self._path(key, allow_empty=True))

    def put_dir(self, local_dir: Path, key: str) -> str:
        target = self._path(key)
        files = source_files(local_dir)
        with atomic_dir(target) as tmp:

            def copy(path: Path, rel: str) -> dict:
                meta = file_meta(path, copy_to=tmp / rel)
                fault_point("store.upload")
                return meta

            metas = run_all([lambda p=path, r=rel: copy(p, r) for rel, path in files], self.threads)
            manifest = {rel: meta for (rel, _), meta in zip(files, metas)}
            (tmp / MANIFEST).write_bytes(manifest_bytes(check_key(key), manifest))
        return str(target)

    def get_dir(self, key: str, local_dir: Path) -> Path:
        src, uri = self._path(key), self.uri(key)
        if not (src / MARKER).is_file():
            raise IncompleteArtifact(f"{uri}: not a complete artifact (no {MARKER} marker)")
        manifest = src / MANIFEST
        entries = manifest_entries(uri, manifest.read_bytes() if manifest.is_file() else None)
        with atomic_fill(local_dir) as tmp:

            def fetch(rel: str, expected: dict) -> None:
                path = src / rel
                if not path.is_file():
                    raise CorruptArtifact(f"{uri}/{rel} is listed in its manifest but missing")
                verify(uri, rel, expected, file_meta(path, copy_to=tmp / rel))

            run_all([lambda r=rel, e=expected: fetch(r, e) for rel, expected in entries], self.threads)
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

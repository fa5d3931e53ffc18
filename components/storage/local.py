"""Local artifact helpers: atomic directory writes with a completion marker.

A directory is complete only once its `_COMPLETE` marker exists; the marker is written last, after the
content was fully written under a temporary name and renamed into place, so a crash never leaves a
half-written directory that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = "_COMPLETE"


class HomeStateError(RuntimeError):
    """What the run home holds conflicts with the command (e.g. checkpoints of another run); the message
    says what to do."""


def weights_fingerprint(model_dir: str | Path) -> str:
    """sha256 over a model directory's safetensors files: which exact weights a run started from."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def is_complete(path: str | Path) -> bool:
    """True when `path` holds a completed artifact."""
    return (Path(path) / MARKER).is_file()


@contextmanager
def atomic_fill(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory to fill; on success it replaces `path`, on error it is removed.

    An existing `path` loses its marker before it is removed, so a crash while removing it never leaves a
    half-deleted directory that still looks complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path)
    os.replace(tmp, path)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Like `atomic_fill`, and the directory gets its completion marker last."""
    path = Path(path)
    with atomic_fill(path) as tmp:
        yield tmp
    mark_complete(path)


def mark_complete(path: str | Path, **info) -> None:
    """Write the completion marker of a directory whose content is whole (`info` is recorded in it)."""
    (Path(path) / MARKER).write_text(json.dumps({**info, "completed_at": time.time()}))


def write_json(path: str | Path, data: dict) -> Path:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path

"""Checkpoints behind a small `CheckpointStore` protocol; the local-directory store lives here (S3 comes with
the pipeline issue).

A checkpoint is written under `step-<n>/` in a temporary sibling first, with a `manifest.json` holding the
sha256 and size of every file, renamed into place, and only then given its `_COMPLETE` marker. Readers trust
only complete steps and verify the manifest on load, so a half-written or corrupted checkpoint is never
mistaken for a whole one.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, Protocol

import torch

from components.storage import atomic_dir, is_complete

MANIFEST = "manifest.json"


class CheckpointStore(Protocol):
    def save(self, step: int, payload: dict[str, Any]) -> str: ...

    def latest_step(self) -> int | None: ...

    def load(self, step: int) -> dict[str, Any]: ...


class LocalCheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def save(self, step: int, payload: dict[str, Any]) -> str:
        """Each payload entry becomes `<name>.pt` (torch.save); returns the checkpoint's path."""
        with atomic_dir(self._dir(step)) as tmp:
            manifest = {}
            for name, obj in payload.items():
                buffer = io.BytesIO()
                torch.save(obj, buffer)
                data = buffer.getvalue()
                (tmp / f"{name}.pt").write_bytes(data)
                manifest[f"{name}.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=2))
        return str(self._dir(step))

    def steps(self) -> list[int]:
        if not self.root.exists():
            return []
        return sorted(int(p.name.split("-", 1)[1]) for p in self.root.glob("step-*") if is_complete(p))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int) -> dict[str, Any]:
        path = self._dir(step)
        if not is_complete(path):
            raise FileNotFoundError(f"checkpoint {path} is missing or incomplete (no _COMPLETE marker)")
        manifest = json.loads((path / MANIFEST).read_text())
        payload = {}
        for filename, meta in manifest["files"].items():
            data = (path / filename).read_bytes()
            if hashlib.sha256(data).hexdigest() != meta["sha256"] or len(data) != meta["bytes"]:
                raise ValueError(f"checkpoint {path}: {filename} does not match its manifest sha256")
            payload[filename[: -len(".pt")]] = torch.load(io.BytesIO(data), weights_only=False)
        return payload

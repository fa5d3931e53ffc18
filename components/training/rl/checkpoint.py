"""Checkpoints as artifacts: `<prefix>/step-XXXXXXXX/` holds one torch.save'd `<name>.pt` per payload entry, and
whatever a writer puts beside them (the learner's engines write their own directories: `policy/`, `critic/`).

The artifact store (components/storage/artifacts.py) publishes the files, then a manifest with the sha256 and
size of each, then the `_COMPLETE` marker; only complete steps count, and every file is verified on load. A
half-written checkpoint is therefore never loaded, and `load_latest` steps back past a damaged one to the newest
checkpoint that verifies: a bad checkpoint costs progress, not the run. A store that cannot be reached (its
retries spent) is not a damaged checkpoint: that StoreError propagates, so an outage never sends a resume back
to an older step whose successors it would then overwrite.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from components.config import Config
from components.storage import open_store, resolve_store_uri
from components.storage.artifacts import (
    ArtifactStore,
    CorruptArtifact,
    IncompleteArtifact,
    LocalStore,
    StoreError,
    check_key,
    join,
)

OnCheckpoint = Callable[[int, str], None]
"""Called with (step, URI) once a checkpoint is complete in the store."""
Writer = Callable[[Path], None]
"""Writes files into a checkpoint's local directory before it is published (`Learner.save`)."""
Reader = Callable[[Path], Any]
"""Reads a verified checkpoint's local directory (`Learner.load`); what it returns is what `load` returns."""

_STEP = re.compile(r"step-(\d{8,})")


class CheckpointStore:
    """Numbered checkpoints under `prefix` in an artifact store, staged through a local scratch directory."""

    def __init__(self, store: ArtifactStore, prefix: str, cache_dir: str | Path) -> None:
        self.store = store
        """Where the checkpoints are published (local tree or S3)."""
        self.prefix = check_key(prefix, allow_empty=True)
        """Key under which the `step-XXXXXXXX` artifacts live, e.g. `checkpoints/tiny-cpu` ('' for the root)."""
        self.cache_dir = Path(cache_dir)
        """Local scratch: payloads are written here before publishing and downloaded here to load; each use
        removes what it wrote."""

    @property
    def location(self) -> str:
        """Printable URI of the checkpoints' prefix, for messages."""
        return self.store.uri(self.prefix)

    def key(self, step: int) -> str:
        """The artifact key of `step`."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        return join(self.prefix, f"step-{step:08d}")

    def _scratch(self, what: str) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{what}-", dir=self.cache_dir))

    def save(self, step: int, payload: dict[str, Any], write: Writer | None = None) -> str:
        """Each payload entry becomes `<name>.pt` (torch.save), beside what `write(directory)` writes; returns the
        checkpoint's URI."""
        key = self.key(step)
        for name in payload:
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"checkpoint payload name {name!r} must be a plain file name")
        scratch = self._scratch(f"save-{step:08d}")
        try:
            if write is not None:
                write(scratch)
            for name, obj in payload.items():
                torch.save(obj, scratch / f"{name}.pt")
            return self.store.put_dir(scratch, key)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, ascending."""
        names = self.store.list_complete(self.prefix)
        return sorted(int(m.group(1)) for name in names if (m := _STEP.fullmatch(name)))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int, read: Reader | None = None) -> Any:
        """The checkpoint at `step`, every file verified (IncompleteArtifact / CorruptArtifact otherwise): what
        `read(directory)` returns, or by default the payload (`<name>.pt` files as a dict)."""
        scratch = self._scratch(f"load-{step:08d}")
        try:
            local = self.store.get_dir(self.key(step), scratch / "checkpoint")
            return (read or read_payload)(local)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def discard_after(self, step: int, log: Callable[[str], None]) -> list[int]:
        """An operator's rollback (`sao train --rollback-to STEP`): check that the checkpoint at `step` loads, then
        delete every newer one (each loses its completion marker first), so a resume continues from `step`.
        Returns the steps deleted; StoreError / ValueError (naming the step) when `step` is no usable checkpoint."""
        if step not in self.steps():
            raise ValueError(
                f"--rollback-to: no complete checkpoint at step {step} in {self.location}; "
                f"complete: {self.steps() or 'none'}"
            )
        self.load(step)  # raises, naming the object, when it does not verify
        newer = [s for s in self.steps() if s > step]
        for s in reversed(newer):
            self.store.delete(self.key(s))
            log(f"checkpoint: deleted step {s} (rolled back to step {step})")
        return newer

    def load_latest(
        self,
        log: Callable[[str], None],
        at_most: int | None = None,
        read: Reader | None = None,
        at_least: int = 0,
    ) -> tuple[int, Any] | None:
        """(step, what `load(step, read)` returns) of the newest complete checkpoint (at step <= `at_most` when
        given, and >= `at_least`) that loads and verifies; one that is corrupt or no longer complete is skipped with
        a log line saying why. None when none loads. Any other StoreError (the store unreachable after its retries)
        is raised, naming the key."""
        for step in reversed(self.steps()):
            if (at_most is not None and step > at_most) or step < at_least:
                continue
            try:
                return step, self.load(step, read)
            except (CorruptArtifact, IncompleteArtifact) as exc:
                log(f"checkpoint: skipping step {step}, it does not load: {exc}")
        return None


def read_payload(directory: Path) -> dict[str, Any]:
    """A checkpoint's payload: its top-level `<name>.pt` files as {name: object}."""
    return {path.stem: torch.load(path, weights_only=False) for path in sorted(Path(directory).glob("*.pt"))}


class LocalCheckpointStore(CheckpointStore):
    """Checkpoints in one local directory: `root/step-XXXXXXXX/{*.pt, manifest.json, _COMPLETE}`, scratch in
    `root/.cache`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        """The directory holding the `step-XXXXXXXX` checkpoints."""
        super().__init__(LocalStore(self.root), "", self.root / ".cache")


def checkpoint_store(cfg: Config, home: Path) -> CheckpointStore:
    """This config's checkpoints: `checkpoints/<name>/step-<n>` in the artifact store (`store.uri`, else
    `$SAO_STORE_URI`, else the run home)."""
    uri = resolve_store_uri(cfg.store.uri, home)
    store = open_store(uri, **cfg.store.options(uri))
    return CheckpointStore(store, f"checkpoints/{cfg.name}", Path(home) / "cache" / "checkpoints")


class Checkpointer:
    """A run's checkpoints with a failure budget: a checkpoint lost to a store outage (its retries spent) does not
    end the run, up to `max_failures` in a row (`train.checkpoint_failures`; docs/reliability.md). The first
    checkpoint of a process and the run's last one must be stored: without them there is nothing to resume
    from, or the result is lost."""

    def __init__(
        self,
        store: CheckpointStore,
        max_failures: int,
        on_checkpoint: OnCheckpoint | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.store, self.max_failures, self.log = store, max_failures, log
        self.on_checkpoint = on_checkpoint or (lambda step, uri: None)
        self.stored = 0
        """Checkpoints this process stored."""
        self.failed = 0
        """Checkpoints this process could not store (`trainer/checkpoint_failures`)."""
        self.failed_in_a_row = 0

    def save(self, step: int, payload: dict[str, Any], final: bool = False, write: Writer | None = None) -> str | None:
        """Store `payload` (and what `write` writes) as checkpoint `step` and call `on_checkpoint(step, uri)`;
        returns the URI, or None when the store failed and the budget lets the run go on. Raises the `StoreError`
        otherwise (`final`: the run's last checkpoint)."""
        try:
            uri = self.store.save(step, payload, write)
        except StoreError as exc:  # the store's retries are spent: an outage, or a store that never worked
            self.failed += 1
            self.failed_in_a_row += 1
            if not self.stored or final or self.failed_in_a_row > self.max_failures:
                raise
            self.log(
                f"train: checkpoint {step} not stored ({exc}); training goes on, {self.failed_in_a_row} of "
                f"train.checkpoint_failures={self.max_failures} in a row"
            )
            return None
        self.stored += 1
        self.failed_in_a_row = 0
        self.on_checkpoint(step, uri)
        return uri

"""Checkpoints as artifacts: `<prefix>/step-XXXXXXXX/` holds one torch.save'd `<name>.pt` per payload entry, and
whatever a writer puts beside them (the learner's engines write their own directories: `policy/`, `critic/`).

The artifact store (components/storage/artifacts.py) publishes the files, then a manifest with the sha256 and
size of each, then the `_COMPLETE` marker; only complete steps count, and every file is verified on load. A
half-written checkpoint is therefore never loaded, and `load_latest` steps back past a damaged one to the newest
checkpoint that verifies: a bad checkpoint costs progress, not the run. A store that cannot be reached (its
retries spent) is not a damaged checkpoint: that StoreError propagates, so an outage never sends a resume back
to an older step whose successors it would then overwrite.

A run's `Checkpointer` splits a save in two (issue 42, item 10). The loop writes the checkpoint into local scratch
(`CheckpointStore.stage`: the learner's engines, a collective write on every rank, and the payload): that much
must happen between two steps. Hashing and publishing it (`CheckpointStore.publish`) run on a thread of their
own while the loop trains on; one checkpoint is in flight at a time, so the next save, the collapse guard's
roll back and the end of the run first wait for it (`Checkpointer.wait`), and local scratch holds one checkpoint.
"""

from __future__ import annotations

import contextvars
import re
import shutil
import tempfile
import threading
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
"""Called with (step, URI) once a checkpoint is complete in the store: on the upload's thread, as soon as it is."""
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
        checkpoint's URI once it is complete in the store (`stage`, then `publish`)."""
        return self.publish(step, self.stage(step, payload, write))

    def stage(self, step: int, payload: dict[str, Any], write: Writer | None = None) -> Path:
        """Write checkpoint `step` into a new local scratch directory and return it: what `write(directory)` writes,
        and each payload entry as `<name>.pt` (torch.save). Nothing reaches the store; `publish` does that."""
        self.key(step)
        for name in payload:
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"checkpoint payload name {name!r} must be a plain file name")
        scratch = self._scratch(f"save-{step:08d}")
        try:
            if write is not None:
                write(scratch)
            for name, obj in payload.items():
                torch.save(obj, scratch / f"{name}.pt")
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        return scratch

    def publish(self, step: int, scratch: Path) -> str:
        """Publish a `stage`d directory as checkpoint `step` (files, manifest, marker) and remove it, also when
        the store fails; returns the checkpoint's URI."""
        try:
            return self.store.put_dir(scratch, self.key(step))
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
        self._delete(reversed(newer), f"rolled back to step {step}", log)
        return newer

    def prune(self, keep: int, log: Callable[[str], None]) -> list[int]:
        """Delete the complete checkpoints older than the newest `keep` (`train.keep_checkpoints`; 0 keeps all),
        oldest first, each losing its completion marker first; returns the steps deleted."""
        if keep <= 0:
            return []
        old = self.steps()[:-keep]
        self._delete(old, f"train.keep_checkpoints={keep} newest are kept", log)
        return old

    def _delete(self, steps, why: str, log: Callable[[str], None]) -> None:
        """Delete the checkpoints at `steps`, in that order (each loses its marker first), logging each with `why`."""
        for s in steps:
            self.store.delete(self.key(s))
            log(f"checkpoint: deleted step {s} ({why})")

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


class Upload(threading.Thread):
    """One checkpoint's publication on a thread of its own: `publish(step, scratch)`, then `on_checkpoint(step,
    uri)`, then the older checkpoints beyond `keep` deleted, in the context (contextvars) of the thread that started
    it. Its outcome waits in `uri` and `error` for the loop's thread to read after `join`."""

    def __init__(
        self,
        store: CheckpointStore,
        step: int,
        scratch: Path,
        final: bool,
        on_checkpoint: OnCheckpoint,
        keep: int = 0,
    ) -> None:
        super().__init__(name=f"sao-checkpoint-{step:08d}")  # not a daemon: an exiting process finishes it
        self.store, self.step, self.scratch, self.final, self.on_checkpoint = store, step, scratch, final, on_checkpoint
        self.keep = keep
        """Checkpoints kept once this one is complete (`CheckpointStore.prune`; 0: all)."""
        self.notes: list[str] = []
        """Log lines of the pruning, written by the loop's thread when it waits."""
        self.context = contextvars.copy_context()
        self.uri: str | None = None
        """The checkpoint's URI once it is complete in the store."""
        self.error: BaseException | None = None
        """What the publication (or `on_checkpoint`) raised."""

    def run(self) -> None:
        try:
            self.uri = self.context.run(self.store.publish, self.step, self.scratch)
            self.context.run(self.on_checkpoint, self.step, self.uri)
        except BaseException as exc:  # handed to the loop's thread by `Checkpointer.wait`, never dropped
            self.error = exc
            return
        try:
            self.context.run(self.store.prune, self.keep, self.notes.append)
        except StoreError as exc:  # the next checkpoint prunes again: a failed deletion costs storage, not the run
            self.notes.append(f"checkpoint: could not delete old checkpoints after step {self.step}: {exc}")


class Checkpointer:
    """A run's checkpoints, published in the background with a failure budget, the newest `keep` kept
    (`train.keep_checkpoints`; 0: all): a checkpoint lost to a store
    outage (its retries spent) does not end the run, up to `max_failures` in a row (`train.checkpoint_failures`;
    docs/reliability.md). The first checkpoint of a process and the run's last one must be stored: without them
    there is nothing to resume from, or the result is lost. An upload's outcome is counted, and its error raised,
    on the loop's thread when it next waits: at the next save, the guard's roll back or the end of the run."""

    def __init__(
        self,
        store: CheckpointStore,
        max_failures: int,
        on_checkpoint: OnCheckpoint | None = None,
        log: Callable[[str], None] = print,
        keep: int = 0,
    ) -> None:
        self.store, self.max_failures, self.log, self.keep = store, max_failures, log, keep
        self.on_checkpoint = on_checkpoint or (lambda step, uri: None)
        self.stored = 0
        """Checkpoints this process stored (counted when waited for)."""
        self.failed = 0
        """Checkpoints this process could not store (`trainer/checkpoint_failures`; counted when waited for)."""
        self.failed_in_a_row = 0
        self.in_flight: Upload | None = None
        """The checkpoint being published, until `wait` reads its outcome."""

    def save(self, step: int, payload: dict[str, Any], final: bool = False, write: Writer | None = None) -> None:
        """Wait for the checkpoint in flight (`wait`: its failure may raise here), write `payload` and what `write`
        writes as checkpoint `step` into local scratch, and start publishing it on its own thread;
        `on_checkpoint(step, uri)` follows once it is complete in the store. `final` (the run's last
        checkpoint): its failure is raised by `wait`, whatever the budget."""
        self.wait()
        scratch = self.store.stage(step, payload, write)
        self.in_flight = Upload(self.store, step, scratch, final, self.on_checkpoint, self.keep)
        self.in_flight.start()

    def wait(self) -> str | None:
        """Block until the checkpoint in flight is published or failed, and count it. Returns its URI; None when
        none was in flight or the store failed and the budget lets the run go on. Raises the `StoreError`
        otherwise (the process's first checkpoint, the run's last, or one failure too many in a row), and any
        other error of the upload as it is."""
        upload, self.in_flight = self.in_flight, None
        if upload is None:
            return None
        upload.join()
        for line in upload.notes:
            self.log(line)
        if upload.uri is not None:
            self.stored += 1
            self.failed_in_a_row = 0
        if upload.error is None:
            return upload.uri
        if upload.uri is not None or not isinstance(upload.error, StoreError):
            raise upload.error  # on_checkpoint failed, or something else than the store did (a bad file, a bug)
        self.failed += 1  # the store's retries are spent: an outage, or a store that never worked
        self.failed_in_a_row += 1
        if not self.stored or upload.final or self.failed_in_a_row > self.max_failures:
            raise upload.error
        self.log(
            f"train: checkpoint {upload.step} not stored ({upload.error}); training goes on, {self.failed_in_a_row} "
            f"of train.checkpoint_failures={self.max_failures} in a row"
        )
        return None

    def latest_step(self) -> int | None:
        """The newest checkpoint's step: the one in flight, else the store's newest complete one."""
        return self.in_flight.step if self.in_flight is not None else self.store.latest_step()

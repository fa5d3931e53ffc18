"""A slow store for the background-checkpoint tests, and a real trainer over it (in process, or as a child that a
fault point kills: `python -m tests.training.held_store HOME SFT_DIR EVENTS MAX_STEPS HELD`).

`HeldStore` is the local artifact store, except that it publishes one checkpoint only once the test releases it:
a store as slow as the test needs, by a real mechanism and without a clock. What happens is recorded as events
("row 3", "upload 2 released", "stored 2", "announced 2"), in a list and, for a child, in a file, line by line,
so that a test asserts the order of things rather than their timing."""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import replace
from pathlib import Path

from components.config import Config, load_config
from components.envs.registry import build_env
from components.storage import LocalStore
from components.tracking import NullTracker
from components.training.rl.algorithms import settings_from
from components.training.rl.checkpoint import Checkpointer, CheckpointStore
from components.training.rl.learner import Learner
from components.training.rl.parts import build_parts, thread_budget
from components.training.rl.trainer import Trainer, TrainResult

PATIENCE_S = 30.0
"""How long a held upload waits for its release: a loop that does not go on while the upload is held never
releases it (the checkpoint's upload blocks the loop), and the event says so."""

OVERRIDES = [
    'train.backend="torch"',
    "train.batch_size=4",
    "train.checkpoint_every=1",
    "train.threads=1",
    "rollout.concurrency=4",
    "task.eval_size=4",
]
"""The tiny preset as the loop tests run it: a step in about a second, a checkpoint after each."""


class Events:
    """Events in the order they happened, from any thread; each also appended to `path` when given (a child's
    record survives its SIGKILL)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path, self.seen, self.lock = path, [], threading.Lock()

    def __call__(self, event: str) -> None:
        with self.lock:
            self.seen.append(event)
            if self.path is not None:
                with open(self.path, "a") as out:
                    out.write(event + "\n")

    def before(self, first: str, then: str) -> bool:
        """Both happened, `first` before `then`."""
        return first in self.seen and then in self.seen and self.seen.index(first) < self.seen.index(then)


class HeldStore(LocalStore):
    """A local store that starts publishing checkpoint `held` only once `release` is set, waiting `PATIENCE_S`
    at most; every publication is recorded in `events`. `held_run` sets `release` when the row of step
    `release_row` is logged (None: the test sets it)."""

    def __init__(self, root: Path, held: int, events: Events, release_row: int | None = -1) -> None:
        super().__init__(root)
        self.held, self.events, self.release = held, events, threading.Event()
        self.release_row = held + 1 if release_row == -1 else release_row

    def put_dir(self, local_dir: Path, key: str) -> str:
        step = int(key.rsplit("step-", 1)[1])
        if step == self.held:
            self.events(f"upload {step} released" if self.release.wait(PATIENCE_S) else f"upload {step} timed out")
        uri = super().put_dir(local_dir, key)
        self.events(f"stored {step}")
        return uri


def held_run(
    cfg: Config, sft_dir: Path, home: Path, store: HeldStore, resume: bool = False, detector=None, log=print
) -> TrainResult:
    """`train` (components/training/rl/trainer.py) with the run's checkpoints in `store`: each step's row is
    recorded as "row N" and releases the held upload when it is the store's `release_row`; each checkpoint
    complete in the store is recorded as "announced N"."""

    def observe(trainer: Trainer, batch, row: dict) -> None:
        store.events(f"row {trainer.step}")
        if trainer.step == store.release_row:
            store.release.set()

    engine_threads, trainer_threads = thread_budget(cfg)
    learner = Learner(cfg, sft_dir, settings_from(cfg), trainer_threads)

    async def run() -> TrainResult:
        parts = build_parts(
            cfg, build_env(cfg), learner, sft_dir, home, NullTracker(), engine_threads, resume, log, detector
        )
        checkpoints = Checkpointer(
            CheckpointStore(store, f"checkpoints/{cfg.name}", home / "cache" / "checkpoints"),
            cfg.train.checkpoint_failures,
            lambda step, uri: store.events(f"announced {step}"),
            log,
        )
        out = home / "models" / "held-policy"
        return await Trainer(cfg.train, replace(parts, checkpoints=checkpoints), out, log, [observe]).run()

    try:
        return asyncio.run(run())
    finally:
        learner.close()


def tiny(max_steps: int, *more: str) -> Config:
    return load_config("tiny-cpu", [*OVERRIDES, f"train.max_steps={max_steps}", *more])


if __name__ == "__main__":  # a child resuming in HOME; SAO_FAULTS says where it dies
    home, sft_dir, events, max_steps, held = sys.argv[1:6]
    store = HeldStore(Path(home), int(held), Events(Path(events)))
    held_run(tiny(int(max_steps)), Path(sft_dir), Path(home), store, resume=True)

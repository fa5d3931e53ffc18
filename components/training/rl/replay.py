"""The same updates again without the engine (`sao train --replay RUN`), from a run's recorded batches
(components/training/rl/recording.py).

A learner step depends on the learner's states (weights, optimizer moments, the algorithm's own state), the batch
and the learning-rate factor, and not on when each episode finished. So the recorded batches fed in order to a
learner started from the same weights, with the same thread count (a float sum depends on how the work is split
over threads), repeat every update bit for bit. The replay runs the trainer's own loop (`Trainer.run`) with the
recording in the buffer's place and no engine: the schedule, the checkpoints and the collapse guard are the
run's, so a rollback happens at the same step and restores the replay's own checkpoint of the same weights.

With overrides (`sao train --replay RUN --set algo.lam_policy=0.9`) a replay is a study, not a repetition: the
same batches through a changed update. Its policy drifts from the one that sampled them, so DIS masks more as the
replay goes on; it answers "what would this update have done to that batch", best over a window of steps before
something went wrong (`--max-steps` ends a replay early without changing the learning-rate schedule).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from components.config import Config
from components.contracts.environment import EnvSetup
from components.contracts.trajectory import Trajectory
from components.models import load_tokenizer
from components.storage import HomeStateError, weights_fingerprint
from components.tracking import Tracker
from components.training.rl.algorithms import settings_from
from components.training.rl.buffer import BatchesExhausted
from components.training.rl.checkpoint import Checkpointer, checkpoint_store
from components.training.rl.guard import CollapseGuard
from components.training.rl.learner import Learner
from components.training.rl.parts import Log, RunStart, TrainerParts
from components.training.rl.recording import RecordedStep, Recording
from components.training.rl.stability import CollapseDetector
from components.training.rl.trainer import Trainer, TrainResult


class ReplayBatches:
    """The buffer's place in a replayed loop: `take` hands out the recorded batches in order. `strict`: each batch
    must come at the version it came at in the run (a replay that diverged, e.g. rolled back where the run did
    not, is an error naming the step)."""

    def __init__(self, steps: list[RecordedStep], strict: bool, version: int = 0) -> None:
        self.pending, self.strict, self.version = list(steps), strict, version
        # a replay drops and evicts nothing: its batches are the run's
        self.discarded = self.evicted = self.groups_dropped = 0
        self.current: RecordedStep | None = None

    async def take(self, n: int) -> list[Trajectory]:
        if not self.pending:
            raise BatchesExhausted(f"replay: the recording ends at version {self.version}")
        step = self.pending.pop(0)
        if self.strict and step.step != self.version + 1:
            raise ValueError(
                f"replay: the run trained its next recorded batch as step {step.step}, the replay is at version "
                f"{self.version}: the replay diverged from the run"
            )
        batch = step.batch()
        if len(batch) != n:
            raise ValueError(f"replay: {step.parquet_path} holds {len(batch)} trajectories, train.batch_size is {n}")
        self.current = step
        return batch

    async def set_version(self, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        pass


class NoRollouts:
    """The rollouts' place in a replayed loop: nothing generates, and publishing goes nowhere."""

    engine = None
    version = 0
    keeps_weights = False

    async def start(self) -> None:
        """Nothing serves: the recorded batches stand for the engine's samples."""

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.version = version

    async def settle(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def share(self, version: int) -> None:
        return None

    async def close(self) -> None:
        pass


@dataclass
class Comparison:
    """How a replay's rows compare with the recorded ones, metric by metric."""

    steps: int = 0
    identical: int = 0
    """Steps whose every recorded metric the replay reproduced exactly."""
    first_difference: str = ""
    """The first step and metric that differ, with both values."""
    max_abs_diff: dict[str, float] = field(default_factory=dict)

    def observe(self, recorded: RecordedStep, row: dict) -> None:
        self.steps += 1
        same = True
        for key, theirs in recorded.metrics.items():
            ours = row.get(key, float("nan"))
            if theirs == ours or (math.isnan(theirs) and math.isnan(ours)):
                continue
            same = False
            diff = abs(ours - theirs)
            self.max_abs_diff[key] = max(self.max_abs_diff.get(key, 0.0), diff)
            if not self.first_difference:
                self.first_difference = f"step {recorded.step}, {key}: run {theirs!r}, replay {ours!r}"
        self.identical += same

    def summary(self) -> str:
        if self.identical == self.steps:
            return f"replay: all {self.steps} step(s) reproduced the recorded metrics exactly"
        worst = sorted(self.max_abs_diff.items(), key=lambda kv: -kv[1])[:4]
        return (
            f"replay: {self.identical} of {self.steps} step(s) identical; first difference at "
            f"{self.first_difference}; largest differences: " + ", ".join(f"{k} {v:.3g}" for k, v in worst)
        )


@dataclass
class ReplayResult:
    train: TrainResult
    comparison: Comparison
    strict: bool


def replay(
    recording: Recording,
    cfg: Config,
    setup: EnvSetup,
    home: Path,
    tracker: Tracker,
    strict: bool,
    stop_at: int | None = None,
    log: Log = print,
    detector: CollapseDetector | None = None,
) -> ReplayResult:
    """Run the trainer's loop on `recording`'s batches with `cfg` (the recorded config, or a changed one when not
    `strict`) in the fresh run home `home`; stop after version `stop_at` (default: where the recording ends).
    `detector`: the collapse rule, when the run had its own (tests)."""
    manifest = recording.manifest
    if manifest["world_size"] != 1:
        raise ValueError(
            f"--replay: {recording.root} was recorded with {manifest['world_size']} ranks; replays run in one "
            f"process (a data-parallel step is the single-process step of the whole batch up to float sums)"
        )
    sft_dir = Path(manifest["sft_dir"])
    if not sft_dir.is_dir() or weights_fingerprint(sft_dir) != manifest["origin"]:
        raise FileNotFoundError(
            f"--replay: the run started from {sft_dir}, which is missing or holds other weights now "
            f"(fingerprint {manifest['origin']})"
        )
    cfg = replace(cfg, train=replace(cfg.train, record_batches=False), store=replace(cfg.store, uri=str(home)))
    learner = Learner(cfg, sft_dir, settings_from(cfg), manifest["trainer_threads"])
    store = checkpoint_store(cfg, home)
    if store.latest_step() is not None:
        raise HomeStateError(f"{store.location} already holds checkpoints: a replay starts in an empty home")
    guard = CollapseGuard.from_config(cfg.train, detector)
    batches = ReplayBatches(recording.steps, strict)
    parts = TrainerParts(  # no runner, intake or task stream: the batches are the recorded ones
        cfg=cfg,
        setup=setup,
        learner=learner,
        tokenizer=load_tokenizer(sft_dir),
        rollouts=NoRollouts(),
        buffer=batches,
        checkpoints=Checkpointer(store, cfg.train.checkpoint_failures, None, log),
        guard=guard,
        tracker=tracker,
        start=RunStart(0, 0, manifest["origin"], fresh=True),
    )
    comparison = Comparison()

    def compare(trainer: Trainer, batch: list[Trajectory], row: dict) -> None:
        comparison.observe(batches.current, row)

    last = recording.steps[-1].step if recording.steps else 0
    trainer = Trainer(
        cfg.train,
        parts,
        home / "models" / f"{cfg.name}-{cfg.train.algo}-replay",
        log,
        on_step=[compare],
        stop_at=min(stop_at or last, last) if strict else stop_at,
    )
    try:
        result = asyncio.run(trainer.run())
    finally:
        learner.close()
    return ReplayResult(result, comparison, strict)

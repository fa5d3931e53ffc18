"""A run's recorded batches (`train.record_batches`): what each step trained on, so that `sao train --replay` can
repeat the run's updates (components/training/rl/replay.py says how and why that is exact).

    <home>/batches/manifest.json            the run's config, its starting weights (path and fingerprint), the
                                            trainer's thread count and the number of ranks
    <home>/batches/step-00000123.parquet    step 123's batch: its trajectories in the order trained (the contract)
    <home>/batches/step-00000123.json       written last: the row's metrics that depend only on the batch and the
                                            learner's states (the learning-rate factor among them); step 123 made
                                            version 123 from version 122

A step counts once its JSON exists; a crash between the two files leaves a Parquet file that nothing reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from components.config import Config, to_dict
from components.contracts.metrics import ALGORITHM_METRICS, DIAGNOSTIC_METRICS
from components.contracts.trajectory import Trajectory, read_trajectories, write_trajectories
from components.storage import HomeStateError, write_json

if TYPE_CHECKING:
    from components.training.rl.parts import RunStart
    from components.training.rl.trainer import Trainer

MANIFEST = "manifest.json"
BATCHES = "batches"
"""The recording's folder in a run home."""

REPLAYED = (
    *ALGORITHM_METRICS,
    *DIAGNOSTIC_METRICS,
    "reward/mean",
    "rollout/staleness_mean",
    "rollout/staleness_max",
    "trainer/lr_scale",
    "trainer/rollbacks",
)
"""The row's metrics that a replay must reproduce: what the step computed from its batch and states (timings and
the engine's counters are the run's own)."""


def _name(step: int, suffix: str) -> str:
    return f"step-{step:08d}.{suffix}"


class BatchRecorder:
    """The loop's observer that writes every step's batch under `root` (`train.record_batches`). A resumed run
    continues its recording: the steps after the checkpoint it resumed from are dropped first, since they are
    trained again on new batches. A fresh run (no checkpoint to resume) starts the recording over."""

    def __init__(self, root: Path, cfg: Config, sft_dir: Path, threads: int, world: int, start: RunStart) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = self.root / MANIFEST
        if manifest.exists() and not start.fresh:
            recorded = Recording.open(self.root)
            if recorded.manifest["origin"] != start.origin:
                raise HomeStateError(f"{self.root} holds the recorded batches of another run; remove it to start over")
            for step in recorded.steps:
                if step.step > start.step:
                    step.json_path.unlink()
                    step.parquet_path.unlink(missing_ok=True)
            return
        # A fresh start (no checkpoint in the home): whatever was recorded here belongs to a run that is gone.
        for old in [*self.root.glob("step-*.json"), *self.root.glob("step-*.parquet")]:
            old.unlink()
        write_json(
            manifest,
            {
                "config": to_dict(cfg),
                "sft_dir": str(Path(sft_dir).resolve()),
                "origin": start.origin,
                "trainer_threads": threads,
                "world_size": world,
            },
        )

    def __call__(self, trainer: Trainer, batch: list[Trajectory], row: dict) -> None:
        step = trainer.step
        parquet = self.root / _name(step, "parquet")
        tmp = parquet.with_name(f".{parquet.name}.tmp-{os.getpid()}")
        write_trajectories(tmp, batch)
        os.replace(tmp, parquet)
        write_json(
            self.root / _name(step, "json"),
            {"step": step, "metrics": {k: row[k] for k in REPLAYED if k in row}},
        )


@dataclass(frozen=True)
class RecordedStep:
    step: int
    """The policy version this step's update made (from version `step - 1`)."""
    metrics: dict[str, float]
    json_path: Path

    @property
    def parquet_path(self) -> Path:
        return self.json_path.with_suffix(".parquet")

    def batch(self) -> list[Trajectory]:
        return read_trajectories(self.parquet_path)


@dataclass(frozen=True)
class Recording:
    root: Path
    manifest: dict
    steps: list[RecordedStep]
    """Complete steps (their JSON written), in order."""

    @classmethod
    def open(cls, path: str | Path) -> Recording:
        """The recording at `path`: a `batches/` folder, or a run home (or sweep seed home) holding one."""
        path = Path(path)
        root = path if (path / MANIFEST).is_file() else path / BATCHES
        if not (root / MANIFEST).is_file():
            raise FileNotFoundError(
                f"--replay: {path} holds no recorded batches (no {MANIFEST} in it or in {path / BATCHES}); "
                f"runs record them with train.record_batches = true"
            )
        manifest = json.loads((root / MANIFEST).read_text())
        steps = []
        for json_path in sorted(root.glob("step-*.json")):
            record = json.loads(json_path.read_text())
            steps.append(RecordedStep(record["step"], record["metrics"], json_path))
        return cls(root, manifest, steps)

    @property
    def config(self) -> dict:
        return self.manifest["config"]

"""Recorded batches and their replay (components/training/rl/recording.py, replay.py): an asynchronous run records
what it trained on; replays of it give bit-identical weights and the run's own metrics step for step, rollbacks
included; a changed config replays the same batches as a study; a resumed run's recording drops what it retrains."""

from dataclasses import dataclass, replace

import pytest
import torch
from safetensors.torch import load_file

from components.envs.registry import build_env
from components.storage import HomeStateError
from components.tracking import NullTracker
from components.training.rl.recording import BATCHES, REPLAYED, BatchRecorder, Recording
from components.training.rl.replay import replay
from components.training.rl.stability import Collapse, CollapseDetector
from components.training.rl.trainer import train
from tests.cli_args import sao

STEPS = 6


@dataclass
class FiresAt(CollapseDetector):
    """The collapse rule firing once, at `at` (the guard then rolls back to the checkpoint of step 2)."""

    at: int = 4

    def update(self, step: int, reward: float):
        return Collapse(step=step, onset=3, cause="test") if step == self.at else None


def _cfg(tiny_cfg):
    return replace(
        tiny_cfg,
        train=replace(tiny_cfg.train, backend="torch", batch_size=4, max_steps=STEPS, checkpoint_every=2, threads=1),
        rollout=replace(tiny_cfg.rollout, concurrency=6),
    )


@pytest.fixture(scope="module")
def recorded(tiny_cfg, sft_dir, tmp_path_factory):
    """An asynchronous run of 6 steps with a rollback after step 4, recorded."""
    home = tmp_path_factory.mktemp("run")
    result = train(
        _cfg(tiny_cfg), build_env(tiny_cfg), sft_dir, home, NullTracker(), log=lambda _: None, detector=FiresAt()
    )
    return home, result


def _replay(cfg, recording, home, strict=True, **kwargs):
    return replay(
        recording, cfg, build_env(cfg), home, NullTracker(), strict, log=lambda _: None, detector=FiresAt(), **kwargs
    )


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.train.policy_dir / "model.safetensors")


def test_two_replays_give_bit_identical_weights_and_the_runs_metrics(tiny_cfg, recorded, tmp_path):
    home, run = recorded
    recording = Recording.open(home)
    # The rollback after step 4 published the restored weights as version 5: steps 1-4 and 6 were trained.
    assert run.rollbacks == 1 and [s.step for s in recording.steps] == [1, 2, 3, 4, 6]
    assert recording.manifest["trainer_threads"] == 1 and recording.manifest["world_size"] == 1
    first = _replay(_cfg(tiny_cfg), recording, tmp_path / "a")
    second = _replay(_cfg(tiny_cfg), Recording.open(home / BATCHES), tmp_path / "b")
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # ... and they are the run's weights, reached by the run's updates: every recorded metric, step for step.
    original = load_file(run.policy_dir / "model.safetensors")
    assert all(torch.equal(a[k], original[k]) for k in a)
    assert first.comparison.identical == first.comparison.steps == 5, first.comparison.summary()
    assert first.train.rollbacks == 1 and first.train.version == run.version
    for theirs, ours in zip(run.history, first.train.history):
        assert {k: theirs[k] for k in REPLAYED if k in theirs} == {k: ours[k] for k in REPLAYED if k in theirs}
    assert "policy/loss" in first.train.history[0] and "adv/failed_mean" in first.train.history[0]


def test_a_changed_config_replays_the_same_batches_as_a_study(tiny_cfg, recorded, tmp_path):
    home, run = recorded
    recording = Recording.open(home)
    cfg = _cfg(tiny_cfg)
    cfg = replace(cfg, algo=replace(cfg.algo, lam_policy=0.5))
    study = _replay(cfg, recording, tmp_path / "study", strict=False, stop_at=3)
    assert study.train.version == 3 and study.comparison.steps == 3
    # The first step's batch is the same and so is its reward; the advantages (lambda) and so the update are not.
    assert study.train.history[0]["reward/mean"] == run.history[0]["reward/mean"]
    # ... and it differs from the first step on, first in the advantages (the recorded metrics sort by name).
    assert study.comparison.identical == 0 and study.comparison.first_difference.startswith("step 1, adv/")


def test_a_strict_replay_that_diverges_from_the_run_is_an_error(tiny_cfg, recorded, tmp_path):
    home, _ = recorded
    # Without the run's collapse rule the replay does not roll back after step 4, so it meets step 6's batch at
    # version 4.
    with pytest.raises(ValueError, match="recorded batch as step 6, the replay is at version 4"):
        replay(
            Recording.open(home), _cfg(tiny_cfg), build_env(tiny_cfg), tmp_path, NullTracker(), True, log=lambda _: None
        )


def test_a_resumed_run_drops_the_recorded_steps_it_trains_again(tiny_cfg, recorded, tmp_path, sft_dir):
    import shutil

    from components.storage import weights_fingerprint
    from components.training.rl.parts import RunStart

    home, _ = recorded
    copy = tmp_path / BATCHES
    shutil.copytree(home / BATCHES, copy)
    origin = weights_fingerprint(sft_dir)
    BatchRecorder(copy, tiny_cfg, sft_dir, 1, 1, RunStart(3, 12, origin, fresh=False))
    assert [s.step for s in Recording.open(copy).steps] == [1, 2, 3]
    assert not (copy / "step-00000004.parquet").exists()
    with pytest.raises(HomeStateError, match="recorded batches of another run"):
        BatchRecorder(copy, tiny_cfg, sft_dir, 1, 1, RunStart(3, 12, "other weights", fresh=False))
    # A fresh start (no checkpoint left to resume from) records from scratch.
    BatchRecorder(copy, tiny_cfg, sft_dir, 1, 1, RunStart(0, 0, "other weights", fresh=True))
    assert Recording.open(copy).steps == [] and Recording.open(copy).manifest["origin"] == "other weights"


def test_sao_train_replay_refuses_a_folder_without_a_recording(tmp_path):
    import subprocess

    done = subprocess.run(
        sao("train", "--replay", str(tmp_path), "--home", str(tmp_path / "home")), capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"sao: --replay: {tmp_path} holds no recorded batches")


@pytest.mark.slow  # a subprocess and an evaluation, or greedy decodes: make test-slow
def test_sao_train_replay_reproduces_a_recorded_run_up_to_a_step(recorded, tmp_path):
    import subprocess

    from tests.conftest import child_env

    home, _ = recorded
    # --max-steps 4 ends the replay before the run's test-only rollback (its collapse rule is not the config's).
    done = subprocess.run(
        sao(
            "train",
            "--replay",
            str(home),
            "--home",
            str(tmp_path),
            "--max-steps",
            "4",
            "--set",
            'tracking.backend="disk"',
        ),
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "replay: all 4 step(s) reproduced the recorded metrics exactly" in done.stdout
    assert "replay: held-out accuracy" in done.stdout


@pytest.mark.slow  # a subprocess and an evaluation, or greedy decodes: make test-slow
def test_the_first_action_probe_reads_a_recorded_run(recorded):
    from bench.first_action import report

    home, _ = recorded
    lines = report(home, None)
    assert lines[0].startswith(f"{home}: ") and "held-out prompts in the mental zone" in lines[0]
    assert "steps 1-50: " in lines[1]  # zone episodes trained on / opened with the tool call
    # One entry per checkpoint: steps 0, 2 and 4, the rollback's version 5, and 6.
    assert [entry.split(":")[0] for entry in lines[2].rsplit(": ", 1)[1].split(", ")] == ["0", "2", "4", "5", "6"]
    assert lines[3].rsplit(": ", 1)[1].startswith("0:")  # the zone's code is checked at step 0 (every 50th)

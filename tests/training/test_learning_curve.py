"""Learning-curve regression: a short synchronous SAO run from the test SFT policy, compared with stored values.

Sync mode trains on task-ordered batches and every request has its own seeded sampler, so the run is
reproducible. Rollouts use the policy 2 versions back (`train.sync_lag`), as an asynchronous run would, so
DIS has off-policy tokens to weigh and mask. A change to the math (GAE, DIS, critic updates), to sampling or to batching shows up here as
a different reward curve or loss. After an intended change, regenerate with
`SAO_UPDATE_CURVE=1 make test` (and say why in the commit).
"""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from components.envs.registry import build_env
from components.tracking import NullTracker
from components.training.trainer import train


def train_env(cfg, *args, **kwargs):
    """The trainer on the config's own environment (`jobs.run_train` does the same)."""
    return train(cfg, build_env(cfg), *args, **kwargs)


STORED = Path(__file__).with_name("learning_curve.json")
EXACT = ("reward/mean", "rollout/staleness_max")
CLOSE = ("dis/masked_frac_low", "dis/masked_frac_high", "dis/ratio_mean", "policy/loss", "critic/loss",
         "critic/explained_variance")


def _curve(tiny_cfg, sft_dir, home, threads: int) -> dict[str, list[float]]:
    cfg = replace(tiny_cfg,
                  # A constant learning rate: this pins the math, whatever schedule the preset uses.
                  train=replace(tiny_cfg.train, algo="sao", sync=True, sync_lag=2, backend="torch", batch_size=8,
                                max_steps=8, policy_lr=5e-4, checkpoint_every=0, threads=threads, warmup_steps=0,
                                min_lr_ratio=1.0, collapse_guard="off"),
                  rollout=replace(tiny_cfg.rollout, concurrency=8, engine_threads=threads))
    result = train_env(cfg, sft_dir, home, NullTracker(), log=lambda _: None)
    return {key: [row[key] for row in result.history] for key in EXACT + CLOSE}


def test_learning_curve_matches_stored_values(tiny_cfg, sft_dir, tmp_path):
    curve = _curve(tiny_cfg, sft_dir, tmp_path, threads=2)
    if os.environ.get("SAO_UPDATE_CURVE"):
        STORED.write_text(json.dumps(curve, indent=1) + "\n")
    stored = json.loads(STORED.read_text())
    for key in EXACT:
        assert curve[key] == stored[key], key
    for key in CLOSE:
        assert curve[key] == pytest.approx(stored[key], rel=1e-3, abs=1e-5), key
    assert len(set(curve["policy/loss"])) == len(curve["policy/loss"])  # every step trained on something new
    assert curve["rollout/staleness_max"][-1] == 2 and max(curve["dis/masked_frac_low"]) > 0  # lag, and DIS acts

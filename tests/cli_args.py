"""Command lines for the tests that run `sao` (in process or as a child): the command, `--set` overrides from a dict,
and the small pipeline settings the pipeline tests share."""

import sys


def sao(*args: str) -> list[str]:
    """The `sao` command line run by this interpreter: `sao("train", "--home", ...)`."""
    return [sys.executable, "-m", "components.cli", *args]


def sets(overrides: dict[str, object]) -> list[str]:
    """`{"sft.steps": 20, "train.backend": '"torch"'}` -> `["--set", "sft.steps=20", "--set", 'train.backend="torch"']`
    (string values carry their TOML quotes)."""
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


SMALL_PIPELINE = {
    "sft.steps": 20,
    "sft.batch_size": 16,
    "sft.warmup_steps": 2,
    "task.train_size": 200,
    "task.eval_size": 8,
    "train.max_steps": 4,
    "train.batch_size": 4,
    "rollout.concurrency": 4,
    "train.checkpoint_every": 2,
    "value_pretrain.episodes": 16,
    "value_pretrain.max_epochs": 2,
    "train.backend": '"torch"',
}
"""A whole pipeline in a minute or two: 20 SFT steps, 4 RL steps of 4 trajectories, checkpoints every 2."""

SMALL_TRAIN = {
    "train.batch_size": 4,
    "train.checkpoint_every": 2,
    "rollout.concurrency": 4,
    "task.eval_size": 8,
}
"""A few quick RL steps with a checkpoint every other step."""

"""The other ranks of a stage under torchrun. Rank 0 runs the stage (the `sao` command, or a Prefect flow run on a
GPU pool: flows/ranks.py); every other rank follows it here, then ends its process:

    train           rank 0's SFT policy (its rows of the SFT steps with sft.backend = "deepspeed"), then its rows of
                    every training step
    sft             its rows of the SFT steps (sft.backend = "deepspeed"), or the wait for rank 0's policy
    value-pretrain  the SFT policy as under sft, then its rows of the critic's fitting (value_pretrain.backend)
    pipeline        the stages of the pipeline flow that train, in its order: sft, value-pretrain (when the algorithm
                    has a critic), train (from the pretrained critic when value_pretrain.warm_start)

Rank 0 tells the other ranks what each stage does (`run_sft`, `run_value_pretrain` broadcast it; the learner
scatters its steps), so the followers here call the stages in exactly the order rank 0's flow does.

Nothing is left for a rank once its part returns, and the interpreter's teardown can abort in C++ (gloo or
DeepSpeed threads still joinable: "terminate called without an active exception"), which torchrun reports as the
job failing; so the rank flushes and leaves with `os._exit(0)` (`end_rank_process`, docs/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from components.config import Config
from components.stages.pipeline import starts_warm, uses_critic
from components.stages.sft import join_sft
from components.stages.train import run_train
from components.stages.value_pretrain import join_value_pretrain
from components.training.engines.collective import end_rank_process


def follow_pipeline(cfg: Config, home: Path, resume: bool) -> None:
    """The pipeline flow's training stages on this rank (flows/pipeline.py's order)."""
    join_sft(cfg, home)
    if not uses_critic(cfg):
        run_train(cfg, home, resume=True, evaluate=False)
        return
    critic = join_value_pretrain(cfg, home)
    if starts_warm(cfg):
        cfg = replace(cfg, train=replace(cfg.train, critic_path=str(critic)))
    run_train(cfg, home, resume=True, evaluate=False)


FOLLOWERS: dict[str, Callable[[Config, Path, bool], object]] = {
    "train": lambda cfg, home, resume: run_train(cfg, home, resume=resume),
    "sft": lambda cfg, home, resume: join_sft(cfg, home),
    "value-pretrain": lambda cfg, home, resume: join_value_pretrain(cfg, home),
    "pipeline": follow_pipeline,
}
"""What a non-zero rank does in each stage that runs on several ranks."""


def is_driver() -> bool:
    """True in the process that drives a run: the only one, or rank 0 under torchrun."""
    return int(os.environ.get("RANK", "0")) == 0


def follow(stage: str, cfg: Config, home: Path, resume: bool = False) -> NoReturn:
    """This non-zero rank's part of `stage` (a key of `FOLLOWERS`), then the end of the process."""
    if stage not in FOLLOWERS:
        raise ValueError(f"stage: {stage!r} does not run on several ranks (those that do: {sorted(FOLLOWERS)})")
    FOLLOWERS[stage](cfg, home, resume)
    end_rank_process()

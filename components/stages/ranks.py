"""What the other ranks of a torchrun job do in each stage. The driver (rank 0: `is_driver`, the one rule,
components/training/engines/collective.py) runs the stage: the `sao` command, or a Prefect flow run on a GPU pool
(flows/ranks.py). Every other rank follows it here, then ends its process:

    sft             its rows of the SFT steps (sft.backend = "deepspeed"), or the wait for rank 0's policy
    value-pretrain  the SFT policy as under sft, then its rows of the critic's fitting (value_pretrain.backend)
    train           the SFT policy and the starting critic as rank 0 finds them (`starting_critic`: the pretrained one
                    when value_pretrain.warm_start), then its rows of every training step
    pipeline        the stages of the pipeline that run on several ranks, in the pipeline's order
                    (components/stages/pipeline.py `order`, which the pipeline flow runs)

Rank 0 tells the other ranks what each stage does (`run_sft`, `run_value_pretrain` broadcast it; the learner
scatters its steps), so the followers call the stages in exactly the order rank 0's flow does.

Nothing is left for a rank once its part returns, and the interpreter's teardown can abort in C++ (gloo or
DeepSpeed threads still joinable: "terminate called without an active exception"), which torchrun reports as the
job failing; so the rank flushes and leaves with `os._exit(0)` (`end_rank_process`, docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from components.config import Config
from components.stages.pipeline import order
from components.stages.sft import join_sft
from components.stages.train import run_train
from components.stages.value_pretrain import join_value_pretrain
from components.training.engines.collective import end_rank_process, is_driver

__all__ = ["FOLLOWERS", "follow", "is_driver"]


def follow_pipeline(cfg: Config, home: Path, resume: bool) -> None:
    """The pipeline's stages that run on several ranks, in the pipeline's order (a pipeline always resumes)."""
    for stage in order(cfg):
        if stage in STAGE_FOLLOWERS:
            STAGE_FOLLOWERS[stage](cfg, home, True)


STAGE_FOLLOWERS: dict[str, Callable[[Config, Path, bool], object]] = {
    "sft": lambda cfg, home, resume: join_sft(cfg, home),
    "value-pretrain": lambda cfg, home, resume: join_value_pretrain(cfg, home, join_sft(cfg, home)),
    "train": lambda cfg, home, resume: run_train(cfg, home, resume=resume),
}
"""What a non-zero rank does in each stage of the pipeline that runs on several ranks."""

FOLLOWERS: dict[str, Callable[[Config, Path, bool], object]] = {**STAGE_FOLLOWERS, "pipeline": follow_pipeline}
"""What a non-zero rank does in each stage (a `sao` command or a flow's name) that runs on several ranks."""


def follow(stage: str, cfg: Config, home: Path, resume: bool = False) -> NoReturn:
    """This non-zero rank's part of `stage` (a key of `FOLLOWERS`; a flow's name, `value_pretrain`, reads as the
    command's, `value-pretrain`), then the end of the process."""
    stage = stage.replace("_", "-")
    if stage not in FOLLOWERS:
        raise ValueError(f"stage: {stage!r} does not run on several ranks (those that do: {sorted(FOLLOWERS)})")
    FOLLOWERS[stage](cfg, home, resume)
    end_rank_process()

"""Run by test_ranks.py, as one process or under `torchrun --nproc-per-node 2`: a stage as its flow runs it (rank 0)
and as the other ranks follow it (components/stages/ranks.py). Rank 0 writes what the stage returned."""

import json
import sys
from pathlib import Path

from components.config import load_config
from components.stages.ranks import follow, is_driver
from components.stages.sft import run_sft
from components.stages.value_pretrain import run_value_pretrain
from components.training.engines.collective import end_rank_process


def main(home: str, stage: str, out: str, *overrides: str) -> None:
    cfg = load_config("tiny-cpu", list(overrides))
    if not is_driver():
        follow(stage, cfg, Path(home))
    sft_dir = run_sft(cfg, Path(home), log=lambda _: None)
    result = {"sft_dir": str(sft_dir)}
    if stage == "value-pretrain":
        critic, summary = run_value_pretrain(cfg, Path(home), sft_dir, log=lambda _: None)
        result.update(critic=str(critic), summary=summary)
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_rank_process()  # every rank's work is written: the interpreter's teardown may abort in gloo's threads

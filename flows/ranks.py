"""The command of a GPU job: `torchrun --nproc-per-node=N -m flows.ranks`.

A worker starts one container (or pod) per flow run and names the run in `PREFECT__FLOW_RUN_ID`. torchrun starts one
process per GPU there: rank 0 executes the flow run exactly as Prefect's own `python -m prefect.engine` does (states,
logs, artifacts, the checkpoint events), and every other rank follows the flow's stages as a DeepSpeed rank
(components/stages/ranks.py: train, sft, value_pretrain, pipeline), with the config rebuilt from the flow run's
parameters (the same split `sao train` makes under torchrun).
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

from prefect.flow_engine import (  # after flows/__init__.py (this package) set Prefect's settings
    load_flow,
    load_flow_run,
)

from components.config import load_config
from components.stages.home import default_home
from components.stages.ranks import follow

STAGES = {"train": "train", "sft": "sft", "value_pretrain": "value-pretrain", "pipeline": "pipeline"}
"""The flows that train on several ranks, and the stage their other ranks follow (components/stages/ranks.py)."""


def main() -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    flow_run = load_flow_run(flow_run_id=os.environ["PREFECT__FLOW_RUN_ID"])
    params = flow_run.parameters
    overrides = list(params.get("overrides") or [])
    if params.get("critic_path"):
        overrides.append(f'train.critic_path="{params["critic_path"]}"')
    home = Path(params["home"]) if params.get("home") else default_home()
    stage = STAGES.get(load_flow(flow_run).name, "train")
    follow(
        stage, load_config(params.get("preset", "tiny-cpu"), overrides), home, resume=bool(params.get("resume", False))
    )


if __name__ == "__main__":
    main()

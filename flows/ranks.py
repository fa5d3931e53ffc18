"""The command of a GPU job: `torchrun --nproc-per-node=N -m flows.ranks`.

A worker starts one container (or pod) per flow run and names the run in `PREFECT__FLOW_RUN_ID`. torchrun starts one
process per GPU there: the driver (rank 0) executes the flow run exactly as Prefect's own `python -m prefect.engine`
does (states, logs, artifacts, the checkpoint events), and every other rank follows the flow's stage as a DeepSpeed
rank (components/stages/ranks.py: sft, value_pretrain, train, pipeline), with the config rebuilt from the flow run's
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
from components.stages.ranks import follow, is_driver


def main() -> None:
    if is_driver():
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
        return
    flow_run = load_flow_run(flow_run_id=os.environ["PREFECT__FLOW_RUN_ID"])
    params = flow_run.parameters
    cfg = load_config(params.get("preset", "tiny-cpu"), list(params.get("overrides") or []))
    home = Path(params["home"]) if params.get("home") else default_home()
    follow(load_flow(flow_run).name, cfg, home, resume=bool(params.get("resume", False)))


if __name__ == "__main__":
    main()

"""Thin Prefect flows over the components: distill, gate, sft, value_pretrain, train, evaluate, style_shift and
pipeline. Each reads top to bottom and calls `components`; `sao <command>` runs them (Prefect's ephemeral API
unless PREFECT_API_URL names a server)."""

import os
from pathlib import Path

# Set before any flow module imports prefect (it reads its settings on import). Offline by default: no telemetry
# from Prefect or Great Expectations (docs/design.md section 7). The ephemeral API server's first start migrates a fresh
# database: Prefect's default 20 s wait is not enough on 2 busy cores.
for _name, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}.items():
    os.environ.setdefault(_name, _value)

# Prefect opens its sqlite database under PREFECT_HOME and does not create a missing directory (a fresh clone's
# `.sao/prefect`).
if os.environ.get("PREFECT_HOME"):
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)

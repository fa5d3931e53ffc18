"""The gate stage: a Great Expectations suite over a stored dataset, distilled traces or rollout logs (Parquet,
local or s3://). The suites are components/data/gates.py; a failing gate raises `GateFailed` naming each failing
expectation and its first offending rows."""

from __future__ import annotations

import io
from typing import Literal

from components.config import Config
from components.contracts.trajectory import read_trajectories
from components.data.gates import GateReport, check_rollouts
from components.data.problem_sets import read_bytes
from components.data.traces import read_traces
from components.stages.distill import gate_traces

Kind = Literal["traces", "rollouts"]


def read_dataset(kind: Kind, uri: str) -> list:
    """Traces or trajectories from a Parquet file or object."""
    data = io.BytesIO(read_bytes(uri))
    return read_traces(data) if kind == "traces" else read_trajectories(data)


def check(cfg: Config, kind: Kind, rows: list) -> GateReport:
    """The suite of `kind` over `rows` with this config's bounds."""
    if kind == "traces":
        return gate_traces(cfg, rows)
    return check_rollouts(rows, max_tokens=cfg.rollout.max_total_tokens)

"""The `sao` commands that read or write MLflow's store: compare, report, registry and tracking replay. Each takes
`--home` (its mlflow.db) and `--tracking-uri`, and no config."""

from __future__ import annotations

import argparse

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from components.config import TrackingConfig
from components.eval.compare import run_compare
from components.eval.report import run_report
from components.stages.home import default_home
from components.tracking import mlflow_uri, replay_spool, spool_dir
from components.tracking.registry import versions_table


def compare(args: argparse.Namespace) -> None:
    run_compare(args.runs, args.home, args.tracking_uri, args.out)


def report(args: argparse.Namespace) -> None:
    run_report(args.runs, args.home, args.experiment, args.out, args.tracking_uri)


def registry(args: argparse.Namespace) -> None:
    """The registered versions as a table, one row each."""
    client = MlflowClient(args.tracking_uri or mlflow_uri(TrackingConfig(), args.home or default_home()))
    rows = versions_table(client, args.name)
    if not rows:
        print("registry: no registered model yet (evaluate registers each scored checkpoint)")
        return
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    for line in [{k: k for k in keys}, *rows]:
        print("  ".join(line[k].ljust(widths[k]) for k in keys).rstrip())


def tracking_replay(args: argparse.Namespace) -> None:
    """Deliver the spooled records; while the server is still away, what was not sent stays on disk."""
    spools = spool_dir(args.home or default_home())
    if not spools.is_dir():
        print(f"tracking: nothing to replay ({spools} does not exist)")
        return
    try:
        sent = replay_spool(spools, args.tracking_uri)
    except MlflowException as exc:
        raise ConnectionError(
            f"tracking replay: the MLflow server did not take a record ({exc}); the rest stays "
            f"in {spools}: run it again once the server is back"
        ) from exc
    print(f"tracking: {sent} record(s) delivered from {spools}")

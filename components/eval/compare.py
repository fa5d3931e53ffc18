"""`sao compare RUN...`: the key metrics of MLflow runs side by side, and one figure of their curves.

A run is named by its id or its run name (the newest run of that name). Each metric is the mean of the run's last
`tail` points (the last point for evaluation metrics), so a noisy final step does not decide the comparison.
"""

from __future__ import annotations

import os
from pathlib import Path
from statistics import fmean
from typing import Any

KEY_METRICS = (
    "reward/mean",
    "critic/explained_variance",
    "critic/grad_norm",
    "dis/masked_frac_low",
    "dis/masked_frac_high",
    "rollout/staleness_mean",
    "rollout/trajectories_per_s",
    "trainer/idle_frac",
)
PLOTTED = ("reward/mean", "critic/explained_variance", "rollout/staleness_mean", "dis/masked_frac_high")


def resolve_runs(client: Any, names: list[str]) -> list[Any]:
    """Runs by id, else by run name (newest first) across experiments; ValueError names the unknown one."""
    from mlflow.exceptions import MlflowException

    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = []
    for name in names:
        try:
            runs.append(client.get_run(name))
            continue
        except MlflowException:
            pass
        found = client.search_runs(
            experiments,
            filter_string=f"attributes.run_name = '{name}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not found:
            raise ValueError(f"RUN: no MLflow run with id or name {name!r}")
        runs.append(found[0])
    return runs


def metric_history(client: Any, run: Any, key: str) -> list[Any]:
    """The run's points of metric `key` in step order (empty when it never logged it)."""
    return sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)


def summarise(client: Any, run: Any, tail: int = 10) -> dict[str, float | None]:
    """The run's key metrics (mean of the last `tail` points) and its evaluation metrics (last point)."""
    row: dict[str, float | None] = {}
    for key in KEY_METRICS:
        history = metric_history(client, run, key)
        row[key] = fmean(m.value for m in history[-tail:]) if history else None
    for key, value in sorted(run.data.metrics.items()):
        if key.startswith("eval/"):
            row[key] = value
    return row


def table(names: list[str], rows: list[dict]) -> str:
    """Metrics down, runs across."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    width = max(len(k) for k in keys) + 2
    lines = ["metric".ljust(width) + "".join(n[:22].rjust(24) for n in names)]
    for key in keys:
        cells = ["-" if row.get(key) is None else f"{row[key]:.4g}" for row in rows]
        lines.append(key.ljust(width) + "".join(c.rjust(24) for c in cells))
    return "\n".join(lines)


def plot(client: Any, runs: list[Any], labels: list[str], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6))
    for ax, key in zip(axes.flat, PLOTTED):
        for run, label in zip(runs, labels):
            history = metric_history(client, run, key)
            if history:
                ax.plot([m.step for m in history], [m.value for m in history], label=label, linewidth=1)
        ax.set(title=key, xlabel="policy step")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_compare(
    names: list[str], home: Path | None, tracking_uri: str | None, out: Path | None, log=print
) -> tuple[str, Path]:
    """Print the table of `names` and write the plot; returns both."""
    from mlflow.tracking import MlflowClient

    home = Path(home or os.environ.get("SAO_HOME", ".sao"))
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home.resolve()}/mlflow.db"
    client = MlflowClient(uri)
    runs = resolve_runs(client, names)
    labels = [run.info.run_name or run.info.run_id[:8] for run in runs]
    text = table(labels, [summarise(client, run) for run in runs])
    figure = plot(client, runs, labels, out or home / "reports" / "compare.png")
    log(text)
    log(f"plot: {figure}")
    return text, figure

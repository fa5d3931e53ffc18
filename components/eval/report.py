"""`sao report [RUN...]`: MLflow runs side by side in one self-contained HTML file.

One page: a table of the runs (name, id, status, start, duration, preset/algo/env from the `config.*` params, held-out
accuracy first -> last, steps), then one figure per group of docs/design.md section 6 metrics, one line per run, each run in
the same colour everywhere. Curves are smoothed with TensorBoard's debiased EMA and the raw values drawn faintly; a
series of a few points (evaluation metrics, logged at version 0 and at the end) is drawn as markers, unsmoothed.
A run that lacks a metric has no line; a figure no run has data for says "No data" instead of drawing empty axes.

The page needs no network: CSS is inline, plots are inline SVG from matplotlib (text as paths, so the plots look the
same in every browser and need no font), and there is no JavaScript. Runs are resolved like `sao compare` does.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import io
import math
import os
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from components.config import TrackingConfig
from components.eval.compare import metric_history, resolve_runs
from components.tracking import mlflow_uri

PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#8C6D31")
"""Okabe-Ito (colour-blind safe, its yellow left out: unreadable on white), then two darks; run i gets colour i."""
STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))
"""(line style, marker) of the 1st, 2nd... metric drawn on the same axes."""
FEW_POINTS = 12
"""A series with at most this many points is drawn as markers, unsmoothed."""
UNSMOOTHED = ("rollout/staleness_max",)
"""Drawn raw as steps: smoothing a bound would hide the very steps that break it."""
DEFAULT_COUNT = 3
"""`sao report` without RUN: the newest this many finished training runs."""


@dataclass(frozen=True)
class Plot:
    label: str
    panels: tuple[tuple[str, ...], ...]
    """Axes side by side; each lists the metrics drawn on it (shell-style patterns such as `eval/*/accuracy` match
    the metrics the runs logged)."""
    how: str
    """How to read it: what good looks like, in one sentence."""
    percent: bool = False
    zero: bool = False
    """The y axis starts at 0 (quantities whose good value is near 0)."""


PLOTS = (
    Plot(
        "Reward",
        (("reward/mean",),),
        "Mean reward of each training batch: a healthy run climbs, then plateaus; a sudden lasting drop is a collapse.",
    ),
    Plot(
        "Held-out accuracy",
        (("eval/*/accuracy",),),
        "Greedy accuracy on the held-out set, measured before RL (version 0) and after the last step: the last point "
        "should sit above the first.",
        percent=True,
    ),
    Plot(
        "Masked fractions",
        (("dis/masked_frac_low",), ("dis/masked_frac_high",)),
        "Share of tokens whose importance ratio left the DIS window and were masked out of the loss: near 0 is "
        "good; a spike usually precedes a collapse.",
        percent=True,
        zero=True,
    ),
    Plot(
        "Explained variance",
        (("critic/explained_variance",),),
        "How much of the return's variance the critic predicts (1 perfect, 0 no better than a constant): it should "
        "rise early and stay high.",
    ),
    Plot(
        "Critic gradient norm",
        (("critic/grad_norm",),),
        "The critic's gradient norm before clipping: flat or slowly falling is healthy; growing spikes mean the "
        "critic is diverging.",
        zero=True,
    ),
    Plot(
        "Staleness",
        (("rollout/staleness_mean", "rollout/staleness_max"),),
        "Policy versions between sampling a token and training on it (solid mean, dashed max): the max stays "
        "within train.max_staleness; a mean near 0 means barely asynchronous.",
        zero=True,
    ),
    Plot(
        "Trainer idle",
        (("trainer/idle_frac",),),
        "Share of wall-clock time the trainer waited for rollouts: near 0 means the rollouts keep up; near 1 means "
        "the trainer is starved.",
        percent=True,
        zero=True,
    ),
    Plot(
        "Throughput",
        (("rollout/trajectories_per_s",), ("rollout/tokens_per_s",)),
        "Trajectories per second of the trainer's loop, and generated tokens per second: higher is better, and "
        "steady; dips point at the engine or the tools.",
    ),
)

MPL_STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8.5,
    "ytick.labelsize": 8.5,
    "legend.fontsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.edgecolor": "#9ca3af",
    "axes.labelcolor": "#4b5563",
    "axes.titlecolor": "#1f2937",
    "xtick.color": "#6b7280",
    "ytick.color": "#6b7280",
    "axes.grid": True,
    "grid.color": "#e5e7eb",
    "grid.linewidth": 0.8,
    "svg.fonttype": "path",
    "figure.facecolor": "white",
    "axes.facecolor": "white",
}


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first point is not pulled to 0."""
    out, last = [], 0.0
    for n, value in enumerate(values, 1):
        last = weight * last + (1 - weight) * value
        out.append(last / (1 - weight**n))
    return out


def latest_runs(client: Any, experiment: str, count: int = DEFAULT_COUNT) -> list[str]:
    """Ids of the newest `count` finished training runs (those that logged `reward/mean`) of `experiment`."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ValueError(f"--experiment: no MLflow experiment named {experiment!r}")
    runs = client.search_runs(
        [found.experiment_id],
        filter_string="attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=200,
    )
    ids = [r.info.run_id for r in runs if "reward/mean" in r.data.metrics][:count]
    if not ids:
        raise ValueError(f"RUN: no finished training run (one that logged reward/mean) in experiment {experiment!r}")
    return ids


def write_report(
    client: Any, runs: list[str], out: Path, smoothing: float = 0.6, now: dt.datetime | None = None
) -> Path:
    """The HTML report of `runs` (ids or run names) at `out`; ValueError names a run MLflow does not know."""
    resolved = resolve_runs(client, list(runs))
    names = [r.info.run_name or r.info.run_id[:8] for r in resolved]
    labels = [n if names.count(n) == 1 else f"{n} · {r.info.run_id[:7]}" for n, r in zip(names, resolved)]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(resolved))]
    curves = [_curves(client, run) for run in resolved]
    figures = [_figure(plot, curves, labels, colours, smoothing) for plot in PLOTS]
    now = now or dt.datetime.now().astimezone()
    page = _page(resolved, labels, colours, curves, figures, now, smoothing)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def run_report(
    names: list[str],
    home: Path | None,
    experiment: str | None,
    out: Path | None,
    tracking_uri: str | None = None,
    log=print,
) -> Path:
    """`sao report`: `names`, else the newest finished training runs of `experiment`, into `out`
    (default `<home>/reports/report.html`)."""
    from mlflow.tracking import MlflowClient

    home = Path(home or os.environ.get("SAO_HOME", ".sao"))
    tracking = TrackingConfig(uri=tracking_uri or "")
    client = MlflowClient(mlflow_uri(tracking, home))
    runs = names or latest_runs(client, experiment or tracking.experiment)
    path = write_report(client, runs, out or home / "reports" / "report.html")
    log(f"report: {path}")
    return path


def _curves(client: Any, run: Any) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value)]} of every plotted metric the run logged (non-finite points left out)."""
    wanted = [m for plot in PLOTS for panel in plot.panels for m in panel]
    keys = [k for k in sorted(run.data.metrics) if any(fnmatch.fnmatchcase(k, w) for w in wanted)]
    return {k: [(m.step, m.value) for m in metric_history(client, run, k) if math.isfinite(m.value)] for k in keys}


def _figure(plot: Plot, curves: list[dict], labels: list[str], colours: list[str], smoothing: float) -> str:
    """One `<figure class="plot">`: caption, legend of the runs with data, and the SVG or a "No data" note."""
    panels = [
        [
            k
            for pattern in panel
            for k in sorted({k for c in curves for k in c if fnmatch.fnmatchcase(k, pattern)}) or [pattern]
        ]
        for panel in plot.panels
    ]
    metrics = [m for panel in panels for m in panel]
    has = [any(c.get(m) for m in metrics) for c in curves]
    legend = "".join(
        f'<li class="{"" if ok else "absent"}"><i style="background:{colour}"></i>{escape(label)}'
        f"{'' if ok else ' (no data)'}</li>"
        for label, colour, ok in zip(labels, colours, has)
    )
    caption = (
        f'<figcaption><span class="kicker">{escape(plot.label)}</span>'
        f'<h2>{" · ".join(escape(m) for m in metrics)}</h2><p class="how">{escape(plot.how)}</p>'
        f'<ul class="legend">{legend}</ul></figcaption>'
    )
    if any(has):
        body = _svg(plot, panels, curves, colours, smoothing)
    else:
        body = (
            f'<div class="nodata">No data: none of these runs logged '
            f"{' or '.join(f'<code>{escape(m)}</code>' for m in metrics)}.</div>"
        )
    wide = " wide" if len(panels) > 1 else ""
    empty = "" if any(has) else " empty"
    return f'<figure class="plot{wide}{empty}" data-metric="{escape(" ".join(metrics))}">{caption}{body}</figure>'


def _svg(plot: Plot, panels: list[list[str]], curves: list[dict], colours: list[str], smoothing: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    with plt.rc_context(MPL_STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 3.1), layout="constrained", squeeze=False)
        for ax, panel in zip(axes[0], panels):
            drawn = False
            for curve, colour in zip(curves, colours):
                for metric, (style, marker) in zip(panel, STYLES):
                    points = curve.get(metric)
                    if points:
                        _draw(ax, points, colour, style, marker, smoothing, metric in UNSMOOTHED)
                        drawn = True
            if len(panels) > 1:
                ax.set_title(panel[0], loc="left")
            if not drawn:
                ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#9ca3af")
                ax.set(xticks=[], yticks=[])
                continue
            ax.set_xlabel("policy step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if plot.zero:
                ax.set_ylim(bottom=0)
            if plot.percent:
                ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
            if len(panel) > 1:  # which metric is which line style
                ax.legend(
                    handles=[
                        Line2D([], [], color="#4b5563", linestyle=s, label=name) for name, (s, _) in zip(panel, STYLES)
                    ],
                    frameon=False,
                    loc="lower right",
                    bbox_to_anchor=(1, 1),
                    ncols=len(panel),
                    borderaxespad=0.2,
                )
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
        plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]  # no XML prolog or DOCTYPE inside HTML
    # Scale with the page: the viewBox keeps the aspect ratio, CSS sets the width.
    label = escape(", ".join(m for panel in panels for m in panel))
    return re.sub(
        r' width="[\d.]+pt" height="[\d.]+pt"', f' class="chart" role="img" aria-label="{label}"', svg, count=1
    )


def _draw(
    ax: Any, points: list[tuple[int, float]], colour: str, style: str, marker: str, smoothing: float, raw: bool
) -> None:
    """A few points as markers; else the raw values faintly under their EMA, or (`raw`) alone, as steps."""
    steps, values = [p[0] for p in points], [p[1] for p in points]
    if len(points) <= FEW_POINTS:
        ax.plot(steps, values, color=colour, linestyle=style, marker=marker, markersize=5, linewidth=1.6)
        return
    if raw or smoothing <= 0:
        ax.plot(
            steps, values, color=colour, linestyle=style, linewidth=1.4, drawstyle="steps-mid" if raw else "default"
        )
        return
    ax.plot(steps, values, color=colour, linestyle=style, linewidth=0.9, alpha=0.28)
    ax.plot(steps, ema(values, smoothing), color=colour, linestyle=style, linewidth=1.9)


def _row(run: Any, label: str, colour: str, curve: dict, now: dt.datetime) -> str:
    info, params = run.info, run.data.params
    start = dt.datetime.fromtimestamp(info.start_time / 1000).astimezone() if info.start_time else None
    end = info.end_time / 1000 if info.end_time else (now.timestamp() if info.status == "RUNNING" else None)
    duration = _duration(end - start.timestamp()) if start and end else "–"
    accuracy = (
        "<br>".join(
            f"{escape(k.split('/')[1])}: {points[0][1]:.1%}" + (f" → {points[-1][1]:.1%}" if len(points) > 1 else "")
            for k, points in curve.items()
            if fnmatch.fnmatchcase(k, "eval/*/accuracy") and points
        )
        or "–"
    )
    steps = max((s for s, _ in curve.get("reward/mean", [])), default=None)
    cells = [
        f'<i class="swatch" style="background:{colour}"></i>{escape(label)}',
        f'<code title="{escape(info.run_id)}">{escape(info.run_id[:8])}</code>',
        f'<span class="status {escape(info.status.lower())}">{escape(info.status)}</span>',
        start.strftime("%Y-%m-%d %H:%M") if start else "–",
        duration,
        *(escape(params.get(f"config.{k}", "–")) for k in ("name", "train.algo", "env.name")),
        accuracy,
        "–" if steps is None else str(steps),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _duration(seconds: float) -> str:
    """12s, 4m 05s, 2h 03m."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m {s % 60:02d}s" if s < 3600 else f"{s // 3600}h {s % 3600 // 60:02d}m"


def _page(
    runs: list,
    labels: list[str],
    colours: list[str],
    curves: list[dict],
    figures: list[str],
    now: dt.datetime,
    smoothing: float,
) -> str:
    head = ("Run", "Id", "Status", "Started", "Duration", "Preset", "Algorithm", "Env", "Held-out accuracy", "Steps")
    rows = "".join(_row(r, label, c, curve, now) for r, label, c, curve in zip(runs, labels, colours, curves))
    title = "SAO report: " + ", ".join(labels)
    smooth = f"curves smoothed (EMA {smoothing:g}), raw values faint; " if smoothing > 0 else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title><style>{CSS}</style></head>
<body><main>
<header><h1>SAO training report</h1>
<p class="meta">Generated {now.strftime("%Y-%m-%d %H:%M %Z")} · {len(runs)} run{"s" * (len(runs) != 1)} · {smooth}\
series of up to {FEW_POINTS} points as markers · x axis: policy step</p></header>
<div class="card runs"><table><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr></thead>
<tbody>{rows}</tbody></table></div>
<section class="grid">
{chr(10).join(figures)}
</section>
<footer>Made by <code>sao report</code> from the runs' MLflow metrics; no network needed to view it.</footer>
</main></body></html>
"""


CSS = """
:root{--ink:#1f2937;--muted:#6b7280;--line:#e5e7eb;--bg:#f5f6f8}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);
 font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:1380px;margin:0 auto;padding:28px 28px 40px}
h1{font-size:24px;margin:0 0 4px;letter-spacing:-.01em}
.meta{color:var(--muted);margin:0 0 18px}
code{font:12.5px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.card,.plot{background:#fff;border:1px solid var(--line);border-radius:10px;box-shadow:0 1px 2px rgba(0,0,0,.04)}
.runs{overflow-x:auto;margin-bottom:20px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:9px 14px;border-bottom:1px solid var(--line);white-space:nowrap;vertical-align:top}
th{font-size:12px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted);font-weight:600}
tbody tr:last-child td{border-bottom:0}
.swatch,.legend i{display:inline-block;width:11px;height:11px;border-radius:3px;margin-right:7px;vertical-align:-1px}
.status{font-size:12px;font-weight:600;padding:2px 8px;border-radius:999px;background:#eef2f7;color:#475569}
.status.finished{background:#e7f6ec;color:#166534}.status.running{background:#e6f0fb;color:#1d4ed8}
.status.failed{background:#fdecec;color:#b91c1c}.status.killed{background:#f1f1f1;color:#57534e}
.grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:20px}
.plot{margin:0;padding:16px 18px 12px}
.plot.wide{grid-column:1/-1}
.kicker{font-size:12px;font-weight:600;text-transform:uppercase;letter-spacing:.05em;color:var(--muted)}
.plot h2{font:600 15px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;margin:2px 0 4px}
.how{color:var(--muted);margin:0 0 6px;font-size:13px}
.legend{list-style:none;margin:0 0 4px;padding:0;display:flex;flex-wrap:wrap;gap:4px 16px;font-size:13px}
.legend .absent{color:#9ca3af}.legend .absent i{opacity:.35}
.chart{display:block;width:100%;height:auto}
.nodata{display:flex;align-items:center;justify-content:center;min-height:180px;margin-top:8px;border-radius:8px;
 background:repeating-linear-gradient(135deg,#fafafa 0 10px,#f3f4f6 10px 20px);color:var(--muted)}
footer{color:var(--muted);font-size:12.5px;margin-top:22px}
@media (max-width:900px){.grid{grid-template-columns:1fr}main{padding:16px}}
"""

"""The statistics of an experiment's table (`sao experiment`, components/stages/experiment.py): per arm over its
seeds, held-out accuracy (mean, min-max, Student's t 95% interval of the mean), the difference from the reference
arm (Welch's 95% interval and p-value), collapses and rollbacks, and what the runs saw (the reward of their first
50 steps, evictions, staleness, the sampler-trainer mismatch); per preference phase (style-shift), the ceiling reward
and the steps to recover after a flip.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Protocol

from components.eval.online import phase_table


class SeedOutcome(Protocol):
    """What the table reads of one seed's run: the sweep's `SeedResult` (components/stages/sweep.py)."""

    accuracy: float
    """Held-out greedy accuracy after training."""
    delta: float
    """accuracy - the SFT policy's, in points."""
    collapsed: bool
    collapse_step: int | None
    rollbacks: int
    final_reward: float
    minutes: float
    policy_updates: int
    """Steps that moved the policy (advantages with signal); -1 when the run's result predates the count."""
    early_reward: float
    """reward/mean over the run's first 50 steps."""
    evicted: int
    """Trajectories evicted for lag (-1: not known)."""
    staleness_mean: float
    staleness_max: int
    mismatch_kl: float
    """Median rollout/mismatch_kl of the run (NaN: never logged)."""


@dataclass
class ArmResult:
    arm: str
    runs: list[SeedOutcome]
    curves: list[list[float]]
    """reward/mean per policy step, one list per seed."""
    sweep: str
    """The sweep directory under home/sweeps that holds the arm's runs."""


def interval95(values: list[float]) -> tuple[float, float]:
    """Student's t 95% interval of the mean of `values` (NaN, NaN with fewer than two)."""
    if len(values) < 2:
        return math.nan, math.nan
    from scipy.stats import t  # loaded here: only the table needs it

    mean = statistics.fmean(values)
    half = t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """mean(a) - mean(b), the Welch 95% interval of that difference and its two-sided p-value (NaNs with fewer than
    two values on a side, or none spread on both)."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if min(len(a), len(b)) < 2 or statistics.stdev(a) + statistics.stdev(b) == 0:
        return diff, math.nan, math.nan, math.nan
    from scipy.stats import ttest_ind  # loaded here: only the table needs it

    test = ttest_ind(a, b, equal_var=False)
    interval = test.confidence_interval(0.95)
    return diff, float(interval.low), float(interval.high), float(test.pvalue)


def arm_row(result: ArmResult, reference: ArmResult | None = None) -> dict:
    """The table's row of one arm: held-out accuracy in percent (mean, min, max, 95% interval), points over SFT,
    against the reference arm (difference of means, its Welch 95% interval, p), collapses with the step each fired
    at (`-`: only on the held-out set), rollbacks, the steps that moved the policy (min-max over seeds), minutes."""
    accs = [100 * r.accuracy for r in result.runs]
    low, high = interval95(accs)
    collapsed = [r for r in result.runs if r.collapsed]
    versus = (math.nan,) * 4
    if reference is not None and reference is not result:
        versus = welch(accs, [100 * r.accuracy for r in reference.runs])
    return {
        "arm": result.arm,
        "runs": len(accs),
        "mean": statistics.fmean(accs),
        "min": min(accs),
        "max": max(accs),
        "ci95_low": low,
        "ci95_high": high,
        "vs_sft": statistics.fmean(r.delta for r in result.runs),
        "vs_reference": versus[0],
        "vs_reference_low": versus[1],
        "vs_reference_high": versus[2],
        "p": versus[3],
        "collapsed": len(collapsed),
        "collapse_steps": " ".join(str(r.collapse_step or "-") for r in collapsed),
        "rollbacks": sum(r.rollbacks for r in result.runs),
        "policy_updates": _span([r.policy_updates for r in result.runs if r.policy_updates >= 0]),
        "early_reward": _mean([r.early_reward for r in result.runs]),
        "evicted": _span([r.evicted for r in result.runs if r.evicted >= 0]),
        "staleness_mean": _mean([r.staleness_mean for r in result.runs]),
        "staleness_max": _span([r.staleness_max for r in result.runs if r.staleness_max >= 0]),
        "mismatch_kl": _span_of_small([r.mismatch_kl for r in result.runs]),
        "final_reward": statistics.fmean(r.final_reward for r in result.runs),
        "minutes": sum(r.minutes for r in result.runs),
        "sweep": result.sweep,
    }


def phase_rows(result: ArmResult, phases: list[tuple[str, int]]) -> list[dict]:
    """Per preference phase (`(style, steps)`, the schedule's) of one arm: its mean reward over the last 5 steps (the
    phase's ceiling) over seeds, and the steps to recover after the flip (mean over the seeds that recovered, and how
    many did)."""
    tables = [phase_table(curve, phases) for curve in result.curves if curve]
    rows = []
    for i, (style, _) in enumerate(phases):
        ends = [t[i]["reward_end"] for t in tables if len(t) > i]
        recovered = [t[i]["steps_to_recover"] for t in tables if len(t) > i and t[i]["steps_to_recover"] is not None]
        rows.append(
            {
                "arm": result.arm,
                "phase": i + 1,
                "style": style,
                "ceiling_mean": statistics.fmean(ends) if ends else math.nan,
                "ceiling_min": min(ends, default=math.nan),
                "ceiling_max": max(ends, default=math.nan),
                "recover_steps_mean": statistics.fmean(recovered) if recovered else math.nan,
                "recovered": f"{len(recovered)}/{len(ends)}" if i else "-",
            }
        )
    return rows


def _mean(values: list[float]) -> float:
    """The mean of the known values (NaN: none known)."""
    known = [v for v in values if not math.isnan(v)]
    return statistics.fmean(known) if known else math.nan


def _span_of_small(values: list[float]) -> str:
    """`min-max` of the known values in scientific notation (empty when none is known)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return ""
    low, high = min(known), max(known)
    return f"{low:.1e}" if low == high else f"{low:.1e} to {high:.1e}"


def _span(values: list[int]) -> str:
    """`min-max` of per-seed counts (`n` when they agree, empty when none is known)."""
    if not values:
        return ""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"

"""Online learning under shifting preferences: per-phase reward and the steps a run needs to recover after each
flip of the style preference (the `style_shift` flow's artifact).

Recovery after a flip at step s: the first k >= 1 at which the mean reward of the last `window` steps of the new
phase (fewer while fewer exist) reaches `fraction` of the mean reward of the last `window` steps before the flip;
None when the phase ends first.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from components.tracking import DiskTracker


def reward_curve(metrics: Path) -> list[float]:
    """`reward/mean` per policy step of a run, from its JSON lines (`runs/<name>/<algo>.jsonl`), in step order."""
    records = DiskTracker.read(Path(metrics))
    by_step = {r["step"]: r["metrics"]["reward/mean"] for r in records if "reward/mean" in r.get("metrics", {})}
    return [by_step[s] for s in sorted(by_step)]


def phase_table(
    rewards: list[float], phases: list[tuple[str, int]], window: int = 5, fraction: float = 0.9
) -> list[dict]:
    """One row per phase: style, first and last step (1-based policy steps), mean reward, mean reward of its last
    `window` steps, and steps to recover (from the second phase on). `rewards[i]` is the reward of step i + 1; the
    schedule repeats after its last phase, as the environment's does."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    if not phases or any(n < 1 for _, n in phases):
        raise ValueError(f"phases: need at least one phase of >= 1 steps, got {phases}")
    rows: list[dict] = []
    start, i = 0, 0
    while start < len(rewards):
        style, length = phases[i % len(phases)]
        part = rewards[start : start + length]
        row = {
            "phase": i + 1,
            "style": style,
            "first_step": start + 1,
            "last_step": start + len(part),
            "reward_mean": fmean(part),
            "reward_end": fmean(part[-window:]),
            "steps_to_recover": None,
        }
        if rows:
            row["steps_to_recover"] = steps_to_recover(part, rows[-1]["reward_end"], window, fraction)
        rows.append(row)
        start, i = start + length, i + 1
    return rows


def steps_to_recover(rewards: list[float], before: float, window: int, fraction: float) -> int | None:
    """The first k >= 1 with mean(rewards[max(0, k - window):k]) >= fraction * before, else None."""
    target = fraction * before
    for k in range(1, len(rewards) + 1):
        if fmean(rewards[max(0, k - window) : k]) >= target:
            return k
    return None

"""Learning curves of finished sweeps side by side: `python -m bench.sweep_curves SWEEP_DIR...`.

For each sweep (`<home>/sweeps/<name>`, written by `sao sweep`) and each of its seeds: the critic's explained
variance at RL step 1 and over steps 1-10, the mean reward over step windows, the first step at which the
10-step mean reward reaches 0.9, and the final held-out accuracy; then the mean over seeds. The value-pretraining
comparison in the README was made with it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import fmean

WINDOWS = ((1, 10), (11, 50), (51, 100), (101, 200))


def seed_row(seed_dir: Path) -> dict:
    jsonl = next(seed_dir.glob("runs/*/*.jsonl"))
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    steps = {r["step"]: r["metrics"] for r in rows if "reward/mean" in r.get("metrics", {})}
    reward = [steps[s]["reward/mean"] for s in sorted(steps)]
    ev = [steps[s].get("critic/explained_variance", float("nan")) for s in sorted(steps)]
    reach = next((k + 1 for k in range(9, len(reward)) if fmean(reward[k - 9 : k + 1]) >= 0.9), None)
    result = json.loads((seed_dir / "result.json").read_text())
    row = {"seed": seed_dir.name, "ev_step1": ev[0], "ev_1_10": fmean(ev[:10]), "reach_0.9": reach}
    for lo, hi in WINDOWS:
        row[f"reward_{lo}_{hi}"] = fmean(reward[lo - 1 : hi]) if len(reward) >= lo else float("nan")
    row["accuracy"] = result["accuracy"]
    return row


def main(dirs: list[str]) -> None:
    for name in dirs:
        rows = [seed_row(d) for d in sorted(Path(name).glob("seed-*")) if (d / "result.json").exists()]
        if not rows:
            print(f"{name}: no finished seed")
            continue
        keys = [k for k in rows[0] if k != "seed"]
        print(f"\n{Path(name).name}: " + " | ".join(keys))
        for row in rows:
            print(f"  {row['seed']:>8}: " + " | ".join(_fmt(row[k]) for k in keys))
        print(
            "      mean: "
            + " | ".join(
                _fmt(fmean([r[k] for r in rows if r[k] is not None])) if any(r[k] is not None for r in rows) else "-"
                for k in keys
            )
        )


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main(sys.argv[1:])

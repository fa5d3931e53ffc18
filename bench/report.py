"""What the benchmarks that keep a table and a JSON share: where they go, the run's header, the writing."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def out_dir(out: Path | None) -> Path:
    """`out`, else `$SAO_HOME/bench` (default `.sao/bench` in the repository)."""
    return Path(out or Path(os.environ.get("SAO_HOME", str(REPO / ".sao"))) / "bench")


class Header:
    """When a benchmark began, on what, and the load average then; `fields()` adds the load at the end."""

    def __init__(self, machine: str | None = None) -> None:
        self.began = datetime.datetime.now(datetime.UTC)
        self.load = os.getloadavg()
        self.machine = machine or platform.machine()

    def fields(self) -> dict:
        return {
            "date": self.began.isoformat(timespec="seconds"),
            "machine": f"{self.machine}, {os.cpu_count()} cores, {platform.platform()}",
            "load_average_at_start": self.load,
            "load_average_at_end": os.getloadavg(),
        }


def write(out: Path, name: str, text: str, result: dict) -> None:
    """`<name>.md` (the table) and `<name>.json` (every figure) under `out`, and a line saying where."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"  written: {out / f'{name}.md'}, {out / f'{name}.json'}")

"""Metric trackers behind one protocol (torchtune's MetricLoggerInterface pattern). Metrics are logged in
batches, one call per step with every metric of that step, never one call per point (DESIGN section 6)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None:
        """A run resumed from the checkpoint at `step`: forget metrics logged after it by the crashed run."""

    def close(self) -> None: ...


class NullTracker:
    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def rewind(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class DiskTracker:
    """JSON lines: one `{"step", "time", "metrics"}` record per step, appended and flushed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log_params(self, params: dict) -> None:
        self._write({"params": params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "time": time.time(), "metrics": metrics})

    def rewind(self, step: int) -> None:
        """Rewrite the file without the records of steps after `step` (atomically: temp file + rename)."""
        self._file.close()
        kept = [r for r in self.read(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".rewind")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, peak: float, floor: float, warmup: int) -> float:
    """Learning rate at optimizer step `step` (0-based) of `total`."""
    warmup = min(warmup, total)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))

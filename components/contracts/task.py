"""A task: one prompt an environment can run an episode on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    task_id: str
    """Stable id of the prompt/problem."""
    prompt: str
    """The user's request, as the model sees it (without chat markers)."""
    answer: Any = None
    """Reference answer or hidden tests, environment specific; never shown to the model."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything else worth keeping with the trajectory (difficulty, source, `cursor` in a training stream)."""

"""Which exceptions mean a refused input (exit status 2, one `sao: ...` line) rather than a bug (exit status 1)."""

from __future__ import annotations

import sys

from components.storage import HomeStateError, StoreError

OWN_ERRORS = (
    ("components.rollout.pool", "EnginesDown"),
    ("components.rollout.client", "EngineError"),
    ("components.data.teacher_client", "TeacherError"),
    ("components.stages.rehearse", "RehearsalFailed"),
)
"""Errors of heavy modules that mean a bad input or an unreachable service, not a bug (by module and name)."""


def input_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean a refused input (exit status 2). `ValueError` covers `ConfigError`,
    `GateFailed` and the contracts' checks; `OSError` a missing, unreadable or unwritable path, a port in use
    and `ConnectionError`. A class whose module was never imported cannot have been raised, so the heavy
    modules of `OWN_ERRORS` are looked up, not imported."""
    own = tuple(getattr(sys.modules[module], name) for module, name in OWN_ERRORS if module in sys.modules)
    return (ValueError, OSError, HomeStateError, StoreError, *own)

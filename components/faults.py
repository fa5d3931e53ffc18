"""Named fault points for fault-injection tests: `fault_point("store.upload")` costs one dict look-up.

`SAO_FAULTS` names the points to fire and when, as `name@N[:action]` separated by commas: the N-th time
(1-based, counted per process) the code passes `name`, the action happens; `name@N+` fires it the N-th time and
every time after. Actions:

    kill   SIGKILL this process (the default): a crash with no cleanup, no atexit, no flush
    raise  raise `InjectedFault` (an OSError, so it takes the same path as a real I/O failure)

Example: `SAO_FAULTS="store.upload@3"` kills the process in the middle of an upload, after the third file it stored. The
variable is read once, at the first `fault_point` call. Production code never sets it; the points are where
the reliability tests (tests/reliability/) and the soak (`make soak`) aim their faults. Failpoints in this
style are how etcd (gofail) and TiKV (fail-rs) test crash safety.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["InjectedFault", "fault_point", "parse_faults", "POINTS"]

POINTS = (
    "trainer.step",  # between the learner's step and the version bump
    "store.upload",  # after each file of an artifact (a checkpoint) is stored, before its manifest
    "weights.publish",  # after the policy's weights are written for the engines, before they load them
    "weights.bucket",  # after each bucket of a collective weight transfer is broadcast to a server
)
"""Every fault point in the code base; `parse_faults` refuses any other name, so a typo never goes unnoticed."""

ACTIONS = ("kill", "raise")


class InjectedFault(OSError):
    """Raised at a fault point whose action is `raise`."""


def parse_faults(spec: str) -> dict[str, tuple[int, str]]:
    """{point: (hit number, action)} from an `SAO_FAULTS` value, the action suffixed `+` for `@N+`; ValueError
    naming the bad entry."""
    faults: dict[str, tuple[int, str]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, at, rest = entry.partition("@")
        count, _, action = rest.partition(":")
        action = action or "kill"
        every = count.endswith("+")
        count = count.removesuffix("+")
        if name not in POINTS:
            raise ValueError(f"SAO_FAULTS: unknown fault point {name!r} in {entry!r} (known: {', '.join(POINTS)})")
        if not at or not count.isdigit() or int(count) < 1:
            raise ValueError(f"SAO_FAULTS: {entry!r} needs a hit number >= 1, as in {name}@2")
        if action not in ACTIONS:
            raise ValueError(f"SAO_FAULTS: unknown action {action!r} in {entry!r} (known: {', '.join(ACTIONS)})")
        faults[name] = (int(count), action + ("+" if every else ""))
    return faults


_lock = threading.Lock()
_faults: dict[str, tuple[int, str]] | None = None
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Count a pass through `name`; fire its fault when `SAO_FAULTS` says this is the hit."""
    global _faults
    if _faults is None:
        with _lock:
            if _faults is None:
                _faults = parse_faults(os.environ.get("SAO_FAULTS", ""))
    if not _faults or name not in _faults:
        return
    with _lock:
        _hits[name] = hit = _hits.get(name, 0) + 1
    at, action = _faults[name]
    every = action.endswith("+")
    action = action.removesuffix("+")
    if hit != at and not (every and hit > at):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"fault injected at {name} (hit {hit}, SAO_FAULTS)")

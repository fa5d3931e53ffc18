"""math-verify behind a deadline: `verify_equal(pred, gold)` asks the process of `components.envs.math_verifier_worker`.

Why a process: math-verify's own time limits use `signal.alarm`, which raises off the main thread, and a sympy
computation in a thread cannot be stopped. The worker runs math-verify on its main thread with those limits off;
this side sends one request, waits at most `timeout_s`, and on a late, garbled or missing answer kills the worker
(the next call starts a new one) and returns None: no verdict, the caller decides without math-verify. So a call
costs at most `timeout_s` plus, on the first call or after a kill, the worker's start (`START_TIMEOUT_S` at most;
about a second: sympy and the LaTeX parser load).

Thread-safe: one request at a time per `Verifier` (a lock), from any thread. The process-wide `VERIFIER` starts
its worker on first use, so code that never grades a non-integer answer never starts it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

TIMEOUT_S = 5.0
"""Per comparison (both parses and the comparison); math-verify's own defaults are 5 s to parse, 5 s to verify.
Measured comparisons take 1-150 ms (docs/grading.md)."""
START_TIMEOUT_S = 60.0
"""For the worker to load sympy and math-verify (about 1 s; generous for a loaded 2-core machine)."""
_ROOT = Path(__file__).resolve().parents[2]


class Verifier:
    """One math-verify worker process and the lock that serialises requests to it."""

    def __init__(self, timeout_s: float = TIMEOUT_S, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeout_s and start_timeout_s must be > 0, got {timeout_s}, {start_timeout_s}")
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self.restarts = 0
        """Workers killed after a late or failed answer (each costs the next call a start)."""

    def verify_equal(self, pred: str, gold: str) -> bool | None:
        """math-verify's verdict on the answer `pred` against the reference `gold` (both the content of a
        `\\boxed{}`), or None when there is none in time (the worker was late, crashed or never started)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is not None:  # died since the last call
                self._kill()
            if self._proc is None and not self._start():
                return None
            request = json.dumps({"gold": gold, "pred": pred}).encode() + b"\n"
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._kill()
                return None
            answer = self._read_line(time.monotonic() + self.timeout_s)
            if answer is None or not isinstance(answer.get("equal"), bool):
                self._kill()
                return None
            return answer["equal"]

    def close(self) -> None:
        with self._lock:
            self._kill(count=False)

    def _start(self) -> bool:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "components.envs.math_verifier_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""
        if self._read_line(time.monotonic() + self.start_timeout_s) != {"ready": True}:
            self._kill()
            return False
        return True

    def _read_line(self, deadline: float) -> dict | None:
        """The next JSON line from the worker, or None when it comes after `deadline`, is no JSON, or never comes."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the worker exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def _kill(self, count: bool = True) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                with contextlib.suppress(OSError):  # a dead worker's stdin may refuse the flush before close
                    pipe.close()
            self.restarts += count
        self._proc, self._buffer = None, b""


VERIFIER = Verifier()
"""The process-wide verifier that `components.envs.grading` uses."""
atexit.register(VERIFIER.close)

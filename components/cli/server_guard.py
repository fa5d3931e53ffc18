"""Prefect's temporary API server ends with the `sao` process that started it, however that process ends.

Without PREFECT_API_URL a flow starts Prefect's temporary server (`SubprocessASGIServer`: a uvicorn child) and stops
it at exit (`atexit`). A `sao` process that is SIGKILLed (the OOM killer, `kill -9`, a scheduler's preemption) runs no
exit handler, and the server lives on, orphaned, holding a port and its database. `guard_temporary_server` starts
the server before the command's flow does (the flow then finds it running) and a guard process, `python -m
components.cli.server_guard PARENT SERVER`, which waits for either to end (pidfds: no polling) and, when the parent
ended first, terminates the server (SIGTERM, then SIGKILL after `GRACE_S`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

GRACE_S = 5.0
"""Seconds a terminated server has to stop before it is killed (Prefect's own `stop` waits as long)."""


def guard_temporary_server() -> subprocess.Popen | None:
    """Start Prefect's temporary server now, with a guard process that ends it if this process dies first; returns
    the guard. None (nothing started) when PREFECT_API_URL names a server or the temporary one is disabled."""
    # Imported here: prefect's settings are read once flows/__init__.py has set them (run_flows imports it first)
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    server = SubprocessASGIServer()  # one per process: the flow's client gets this same instance, already running
    server.start()
    return start_guard(os.getpid(), server.server_process.pid)


def start_guard(parent: int, server: int) -> subprocess.Popen:
    """A guard process for `server`, which ends it if `parent` ends first."""
    return subprocess.Popen(
        [sys.executable, "-m", "components.cli.server_guard", str(parent), str(server)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the terminal's group reaches the parent, not the guard
    )


def watch(parent: int, server: int) -> bool:
    """Wait until `parent` or `server` ends; if `parent` ended first, end `server`. Returns whether it ended it.
    Both are held by pidfds, so a pid the kernel reuses meanwhile is never signalled."""
    try:
        server_fd = os.pidfd_open(server)
    except ProcessLookupError:
        return False
    try:
        if _ends_first(parent, server_fd):
            return False
        signal.pidfd_send_signal(server_fd, signal.SIGTERM)
        if not _ended(server_fd, GRACE_S):
            signal.pidfd_send_signal(server_fd, signal.SIGKILL)
        return True
    except ProcessLookupError:  # the server ended on its own meanwhile
        return False
    finally:
        os.close(server_fd)


def _ends_first(parent: int, server_fd: int) -> bool:
    """Wait until the parent or the server ends; whether the server did (an exited process's pidfd is readable)."""
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:  # the parent is gone already
        return _ended(server_fd, 0)
    try:
        poller = select.poll()
        poller.register(parent_fd, select.POLLIN)
        poller.register(server_fd, select.POLLIN)
        return server_fd in {fd for fd, _ in poller.poll()}
    finally:
        os.close(parent_fd)


def _ended(fd: int, timeout_s: float) -> bool:
    """Whether the process behind pidfd `fd` ends within `timeout_s`."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))

"""Prefect's temporary server ends with the `sao` process that started it, even a SIGKILLed one
(components/cli/server_guard.py): real processes, no mocks."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from components.cli import server_guard
from components.cli.server_guard import start_guard, watch

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
    "time.sleep(120)",
]


def _spawn(argv=SLEEPER) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)


def _watched(parent: subprocess.Popen, server: subprocess.Popen) -> tuple[threading.Thread, list]:
    ended: list[bool] = []
    thread = threading.Thread(target=lambda: ended.append(watch(parent.pid, server.pid)), daemon=True)
    thread.start()
    time.sleep(0.2)  # the watch holds both pidfds before either ends
    return thread, ended


def test_a_killed_parent_takes_its_server_with_it():
    parent, server = _spawn(), _spawn()
    guard = start_guard(parent.pid, server.pid)
    try:
        time.sleep(0.5)
        assert server.poll() is None and guard.poll() is None  # both alive: the guard only waits
        parent.kill()
        assert server.wait(timeout=20) == -signal.SIGTERM
        assert guard.wait(timeout=20) == 0
    finally:
        for process in (parent, server, guard):
            process.kill()
            process.wait()


def test_a_server_that_ends_first_ends_the_watch_and_the_parent_is_left_alone():
    parent, server = _spawn(), _spawn()
    try:
        thread, ended = _watched(parent, server)
        server.kill()
        thread.join(timeout=10)
        assert ended == [False] and parent.poll() is None
    finally:
        for process in (parent, server):
            process.kill()
            process.wait()


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(monkeypatch):
    monkeypatch.setattr(server_guard, "GRACE_S", 0.5)
    parent, server = _spawn(), _spawn(STUBBORN)
    try:
        assert server.stdout.readline().strip() == b"ready"  # its SIGTERM handler is in place
        thread, ended = _watched(parent, server)
        parent.kill()
        thread.join(timeout=10)
        assert ended == [True] and server.wait(timeout=5) == -signal.SIGKILL
    finally:
        for process in (parent, server):
            process.kill()
            process.wait()


def test_a_parent_already_gone_ends_the_server_at_once():
    parent, server = _spawn(), _spawn()
    parent.kill()
    parent.wait()
    try:
        assert watch(parent.pid, server.pid) is True  # a reaped parent: no pidfd, the server is ended anyway
        assert server.wait(timeout=10) == -signal.SIGTERM
    finally:
        server.kill()
        server.wait()


@pytest.mark.reliability
def test_a_sigkilled_sao_process_leaves_no_prefect_server(tmp_path):
    """The whole path: a process that starts Prefect's temporary server as `sao` does is SIGKILLed; the server ends."""
    script = textwrap.dedent(
        """
        import flows  # Prefect's settings, as `sao` sets them
        from prefect.server.api.server import SubprocessASGIServer
        from components.cli.server_guard import guard_temporary_server
        guard = guard_temporary_server()
        print(SubprocessASGIServer().server_process.pid, guard.pid, flush=True)
        import time; time.sleep(300)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    sao = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, start_new_session=True)
    try:
        server = int(sao.stdout.readline().split()[0])
        assert _running(server)
        sao.kill()
        sao.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(server):
            time.sleep(0.1)
        assert not _running(server), "the temporary server outlived the killed process"
    finally:
        if sao.poll() is None:
            sao.kill()


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody has reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

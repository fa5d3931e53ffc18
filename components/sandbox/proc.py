"""Parent-side helpers of the sandbox: waiting on, killing and reading from sandboxed processes, and what both
launchers (`percall.py`, `zygote.py`) bring back from a call."""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

_STDERR_TAIL_BYTES = 4096


@dataclass(frozen=True)
class Call:
    """What one sandbox call runs with, the same for both launchers (components/sandbox/run.py builds it)."""

    python: str
    """The interpreter (`host.SANDBOX_PYTHON`)."""
    plan: tuple[str, str] | None
    """The sealed root's plan (`rootfs.rootfs_plan`), None without namespaces."""
    sys_path: tuple[str, ...]
    """Directories appended to the program's `sys.path`: where the allowed packages are (`packages.py`)."""
    uid: int
    gid: int
    """Who the program runs as (`nobody` when the caller is root)."""
    limits: tuple[int, int, int, int, int]
    """RLIMIT_AS bytes, RLIMIT_CPU s, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE."""
    tmpfs_bytes: int
    """Size of each private tmpfs."""
    env: dict[str, str]
    """The scrubbed environment (HOME is added per call)."""
    host_dir: str | None
    """Base of the per-call directory on the host (None: the default temp dir)."""
    max_output_bytes: int
    max_file_bytes: int


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (host problem, not the code)."""


@dataclass(frozen=True)
class Outcome:
    """One call as a launcher saw it, before `sandbox.run_python` turns it into a `SandboxResult`.

    `report` is the program process's `ready` line (the layers applied; None when the call was killed or failed
    before it), `status_exit` the program's exit status as its supervisor reported it, `returncode` the status
    of the call's outermost process (from the zygote: the reported status, else PID 1's), for the message when
    setup failed (125: `sandbox setup error: ...` on stderr).
    """

    report: str | None
    status_exit: int | None
    returncode: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stderr_tail: bytes
    truncated: bool
    wall_s: float


def read_output(
    out_fd: int, err_fd: int, max_output_bytes: int, max_file_bytes: int
) -> tuple[bytes, bytes, bytes, bool]:
    """(stdout head, stderr head, stderr tail, truncated): at most `max_output_bytes` of each is read."""
    out_size = os.fstat(out_fd).st_size
    err_size = os.fstat(err_fd).st_size
    stdout_b = os.pread(out_fd, max_output_bytes, 0)
    stderr_b = os.pread(err_fd, max_output_bytes, 0)
    err_tail = os.pread(err_fd, _STDERR_TAIL_BYTES, max(0, err_size - _STDERR_TAIL_BYTES))
    truncated = (
        out_size > max_output_bytes
        or err_size > max_output_bytes
        or (max_file_bytes > 0 and max(out_size, err_size) >= max_file_bytes)
    )
    return stdout_b, stderr_b, err_tail, truncated


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None


def _wait_exit_nowait(pid: int, pidfd: int | None, timeout: float | None) -> bool:
    """Wait until pid has exited without reaping it (the pgid stays reserved).

    Returns True when it exited, False at timeout.
    """
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                events = poller.poll(None if remaining is None else min(math.ceil(remaining * 1000), 3_600_000))
            except InterruptedError:
                continue
            if events:
                return True
            if remaining is not None and time.monotonic() >= deadline:
                return False
    delay = 0.0005
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            return True
        if info is not None:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.01)


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of pid from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def _ns_init_pidfd(unshare_pid: int) -> int | None:
    """pidfd of the namespace's init (the only child of unshare), if running."""
    try:
        with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
            pids = [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return None
    for pid in pids:
        fd = _pidfd_open(pid)
        if fd is None:
            continue
        st = _proc_stat(pid)  # verified after the pidfd pins the process
        if st is not None and st[1] == unshare_pid:
            return fd
        os.close(fd)
    return None


def _read_available(fd: int, buf: bytearray) -> None:
    """Append what can be read from the non-blocking status pipe."""
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        if not chunk:
            return
        buf += chunk


def _parse_status(data: bytes) -> tuple[str | None, int | None, int | None]:
    """(setup report, program exit status, program pid) from the status pipe."""
    report = exit_code = program = None
    for line in data.decode("utf-8", "replace").splitlines():
        key, _, value = line.partition(" ")
        if key == "ready":
            report = value
        elif key in ("exit", "child"):
            try:
                number = int(value)
            except ValueError:
                continue
            if key == "exit":
                exit_code = number
            else:
                program = number
    return report, exit_code, program


def _kill_sandbox(proc: subprocess.Popen, pidfd: int | None, use_ns: bool, status_r: int, status: bytearray) -> None:
    """Kill everything the sandbox started; return once it is gone and reaped."""
    init_fd = None
    if use_ns:
        # SIGKILL to the namespace's init kills every process in it; unshare
        # then reaps it and exits (killing unshare first would leave the init
        # as a zombie for the host's init to reap, counting against
        # RLIMIT_NPROC meanwhile).
        init_fd = _ns_init_pidfd(proc.pid)
        if init_fd is not None:
            try:
                signal.pidfd_send_signal(init_fd, signal.SIGKILL)
            except OSError:
                pass
            _wait_exit_nowait(proc.pid, pidfd, 2.0)
    else:
        # The supervisor (our unreaped child, so its pid is safe to signal)
        # kills the program's whole process tree, reaps it and exits.
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except OSError:
            pass
        if not _wait_exit_nowait(proc.pid, pidfd, 3.0):
            _read_available(status_r, status)
            program = _parse_status(bytes(status))[2]
            if program is not None:
                _kill_group(program)
    # Whatever is left in the group, while the leader (unreaped) still
    # reserves the pgid; then reap the leader.
    _kill_group(proc.pid)
    proc.wait()
    if init_fd is not None:
        # The namespace's init counts as exited only after the kernel has
        # killed and reaped every process in the namespace.
        _wait_exit_nowait(-1, init_fd, 5.0)
        os.close(init_fd)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

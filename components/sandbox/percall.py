"""The per-call path of the sandbox: one fresh interpreter per call.

`run_percall` starts `python -I -S -B -X utf8 -c <bootstrap>` (under `unshare --net --pid --fork --mount
--kill-child` when namespaces are used), where the bootstrap is the text of `seal.py` and
`child.py` (`_sandbox_main`): it seals the root, drops privileges, supervises the program and reports
on a status pipe. It is the path of the degraded sandbox (no namespaces), the fallback when the zygote cannot
start, and what `run.ZYGOTE = False` forces (to compare against the zygote, `bench/sandbox_bench.py`).
The program's source, stdout and stderr are files in a root-only per-call host directory (under `/dev/shm`
with namespaces, where the program cannot see it; the default temp dir otherwise), removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from components.sandbox.proc import (
    Call,
    Outcome,
    SandboxError,
    _kill_group,
    _kill_sandbox,
    _parse_status,
    _pidfd_open,
    _read_available,
    _wait_exit_nowait,
    read_output,
)

# The child side, passed with -c: seal.py (the sealed root, seccomp, audit hook) comes first, the
# child calls its functions.
_BOOTSTRAP = (
    "".join(Path(__file__).with_name(name).read_text() + "\n" for name in ("seal.py", "child.py")) + "_sandbox_main()\n"
)


def run_percall(code: str, timeout_s: float, call: Call, unshare: str | None) -> Outcome:
    """Run `code` in a fresh interpreter; namespaces when `unshare` is given (with the root's `plan`).

    `call.limits` are (RLIMIT_AS bytes, RLIMIT_CPU s, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE); `call.host_dir` is
    the base of the per-call directory (None: the default temp dir).
    """
    use_ns = unshare is not None
    start = time.monotonic()
    top = tempfile.mkdtemp(prefix="sao-sandbox-", dir=call.host_dir)
    fds: list[int] = []
    try:
        files = _make_call_dir(top, code, call, use_ns, fds)
        proc = _spawn(_command(call, use_ns, unshare, files), top, call.env, files)
        os.close(files.status_w)
        fds.remove(files.status_w)
        _forbid_core_dumps(proc.pid)
        status = bytearray()
        timed_out = _wait_or_kill(proc, start, timeout_s, use_ns, files.status_r, status)
        wall_s = time.monotonic() - start
        _read_available(files.status_r, status)
        report, status_exit, _ = _parse_status(bytes(status))
        stdout_b, stderr_b, err_tail, truncated = read_output(
            files.out_fd, files.err_fd, call.max_output_bytes, call.max_file_bytes
        )
        return Outcome(report, status_exit, proc.returncode, timed_out, stdout_b, stderr_b, err_tail, truncated, wall_s)
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _rmtree(top)


@dataclass(frozen=True)
class _CallFiles:
    """What one call's host directory holds: the program, the working directory, and the open descriptors of
    its stdout and stderr files and of both ends of the status pipe."""

    src_path: str
    work: str
    out_fd: int
    err_fd: int
    status_r: int
    status_w: int


def _make_call_dir(top: str, code: str, call: Call, use_ns: bool, fds: list[int]) -> _CallFiles:
    """Write the program into `top`, make its working directory and open its output files and status pipe.

    Each descriptor goes into `fds` as soon as it is open, so the caller closes it whatever fails after."""
    os.chmod(top, 0o711)  # traversable (for the workdir), not listable
    src_path = os.path.join(top, "main.py")
    fd = os.open(src_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(code.encode("utf-8", "surrogatepass"))
    work = os.path.join(top, "work")
    os.mkdir(work, 0o700)
    if os.geteuid() == 0 and not use_ns:
        os.chown(work, call.uid, call.gid)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    out_fd = os.open(os.path.join(top, "stdout"), flags, 0o600)
    fds.append(out_fd)
    err_fd = os.open(os.path.join(top, "stderr"), flags, 0o600)
    fds.append(err_fd)
    status_r, status_w = os.pipe()
    fds += [status_r, status_w]
    return _CallFiles(src_path, work, out_fd, err_fd, status_r, status_w)


def _command(call: Call, use_ns: bool, unshare: str | None, files: _CallFiles) -> list[str]:
    """The bootstrap's command line: the mode, the files, who to run as, the limits, the root's plan and the
    program's `sys.path`, which `child._sandbox_main` reads by position; under `unshare` with namespaces."""
    argv = [call.python, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP]
    argv += ["ns" if use_ns else "plain", files.src_path, files.work, str(files.status_w)]
    argv += [str(v) for v in (call.uid, call.gid, *call.limits, call.tmpfs_bytes, os.getpid())]
    argv += list(call.plan) if call.plan is not None else ["{}", ""]
    argv.append(os.pathsep.join(call.sys_path))
    if use_ns:
        argv = [unshare, "--net", "--pid", "--fork", "--mount", "--kill-child", "--", *argv]
    return argv


def _spawn(argv: list[str], top: str, env: dict[str, str], files: _CallFiles) -> subprocess.Popen:
    """Start the call's process in a session of its own, with the scrubbed `env` (HOME: the working directory),
    inheriting no descriptor but its stdio and the status pipe's write end; `SandboxError` when it cannot start."""
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=files.out_fd,
            stderr=files.err_fd,
            cwd=top,
            env=dict(env, HOME=files.work),
            start_new_session=True,
            close_fds=True,
            pass_fds=(files.status_w,),
        )
    except OSError as exc:
        raise SandboxError(f"cannot start sandbox process {argv[0]!r}: {exc}") from exc


def _forbid_core_dumps(pid: int) -> None:
    """RLIMIT_CORE 0 on the started process, where the platform allows it."""
    try:
        import resource  # Unix only: without it the child keeps its core-dump limit

        resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
    except (ImportError, OSError, ValueError):
        pass


def _wait_or_kill(
    proc: subprocess.Popen, start: float, timeout_s: float, use_ns: bool, status_r: int, status: bytearray
) -> bool:
    """Wait for the call until `timeout_s` after `start`, then kill it; True when it timed out.

    When this returns, every process of the call is gone and the leader reaped; an interrupt (KeyboardInterrupt
    in the caller) kills the sandbox too before it propagates. What the status pipe held when the sandbox was
    killed is appended to `status`."""
    timed_out = False
    pidfd = _pidfd_open(proc.pid)
    try:
        remaining = timeout_s - (time.monotonic() - start)
        if not _wait_exit_nowait(proc.pid, pidfd, max(0.0, remaining)):
            timed_out = True
            _kill_sandbox(proc, pidfd, use_ns, status_r, status)
        else:
            # Sweep the group while the exited (zombie) leader still reserves the pgid, then reap the leader.
            _kill_group(proc.pid)
            proc.wait()
    except BaseException:  # e.g. KeyboardInterrupt in the caller
        if proc.returncode is None:
            _kill_sandbox(proc, pidfd, use_ns, status_r, status)
        raise
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return timed_out


def _rmtree(path: str) -> None:
    def onerror(func, p, exc_info):  # noqa: ANN001 - shutil callback
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=onerror)
    else:
        shutil.rmtree(path, onerror=onerror)

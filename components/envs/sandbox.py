"""Run untrusted, model-generated Python code in a throw-away sandbox.

``run_python(code)`` starts a fresh interpreter per call and returns a frozen
:class:`SandboxResult`.  It never raises because of what the code does; it
raises ``ValueError`` for bad arguments and :class:`SandboxError` only when the
sandbox itself cannot be set up (a host problem, never the code's doing).

Isolation layers (strongest configuration, used when the caller is root and
``unshare`` works; the ``isolation`` field of every result lists what was
actually applied):

1. **Namespaces and a sealed root** -- the child runs under ``unshare --net
   --pid --fork --mount --kill-child``: a new network namespace (only a downed
   loopback, so no network at all, not even to the host's 127.0.0.1), a new
   PID namespace (the code cannot see or signal any process of the host,
   including the caller; when the program ends every process it left behind
   is killed by the kernel) and a private mount namespace.  In it the
   bootstrap (still root; ``sandbox_seal.seal_root``) builds a minimal
   read-only root on a tmpfs -- the interpreter, its standard library
   (without site-/dist-packages) and the shared libraries they load (the
   plan of ``sandbox_rootfs.rootfs_plan``), ``/dev/{null,zero,random,urandom}``,
   a fresh ``/proc`` (``/proc/sys`` read-only), a two-line ``/etc/passwd``,
   size-limited tmpfs ``/tmp``, ``/var/tmp``, ``/dev/shm`` and working
   directory -- and ``pivot_root``s into it, detaching the host's root: the
   repository, the hidden tests, ``/etc``, ``/root``, ``/home``, ``/sys`` and
   the host's temporary directories are not reachable at all.
2. **Unprivileged user** -- a small bootstrap (passed with ``-c``) drops to
   ``nobody`` (uid/gid looked up with :mod:`pwd`, default 65534) in the order
   setgroups -> setresgid -> setresuid, verifies that the drop cannot be
   undone, and sets ``PR_SET_NO_NEW_PRIVS`` (no set-uid escalation).  Root's
   files (``/root``, ``/etc/shadow``, the repository) and root's processes are
   out of reach.
3. **Resource limits**, set by the bootstrap before the code runs:
   RLIMIT_CPU (about the timeout), RLIMIT_AS (``memory_mb``), RLIMIT_FSIZE
   (``max_file_bytes``), RLIMIT_NPROC (``max_processes``; note that it counts
   all processes of ``nobody`` on the host), RLIMIT_NOFILE (64), RLIMIT_CORE 0.
4. **Wall-clock deadline and supervision** -- the child is started in its own
   session/process group.  The program runs as the child of a small
   supervisor (the PID namespace's init; without namespaces a
   ``PR_SET_CHILD_SUBREAPER`` process that keeps the caller's privileges)
   that reaps orphans, reports the exit status and kills everything left
   when the program ends.  At the deadline the namespace's init is SIGKILLed
   (the kernel then kills every process in the namespace) or the supervisor
   is told to kill the program's process tree, then the whole process group
   is SIGKILLed and ``timed_out`` is set.  The call returns only after those
   processes are gone (and reaped: zombies would count against
   RLIMIT_NPROC).
5. **Scrubbed environment and interpreter flags** -- the child sees only PATH,
   LANG, LC_ALL, HOME (= its temporary directory), PYTHONDONTWRITEBYTECODE and
   PYTHONIOENCODING; the interpreter runs with ``-I -S -B -X utf8`` (isolated
   mode, no ``site``; ``exit``/``quit`` are provided by the bootstrap).  The
   program is delivered in a file, never on the command line.
6. **Seccomp filter** (``sandbox_seal.install_seccomp``, both modes): the
   program process refuses (EPERM) unshare, setns, clone with CLONE_NEW*
   flags, mount and the new mount API, pivot_root, chroot, ptrace,
   process_vm_*, pidfd_getfd, keyctl and friends, bpf, perf_event_open,
   userfaultfd, io_uring, kexec, module loading, *_handle_at, acct,
   non-default personality and sockets of any family but AF_UNIX; clone3
   gets ENOSYS (glibc falls back to clone); another ABI (i386, x32) kills the
   process.  On an architecture without a syscall table the result says
   ``NO-SECCOMP(...)`` and a ``RuntimeWarning`` is issued once.
7. **Audit hook** (always installed, third layer): refuses creating non-UNIX
   sockets and connect/bind/sendto/sendmsg/DNS look-ups from Python code.
8. **Bounded output** -- stdout/stderr go to files (bounded by RLIMIT_FSIZE)
   in a root-only per-call directory (under ``/dev/shm`` with namespaces,
   where the program cannot see it; the default temp dir otherwise); only the
   first ``max_output_bytes`` of each are read back (``output_truncated``).

Degradation (loud: a ``RuntimeWarning`` once per process and ``DEGRADED`` in
``isolation``): when the caller is not root, or ``unshare`` is missing or
fails, no namespaces and no tmpfs are used.  The code then still runs as
``nobody`` if the caller is root (so it cannot signal the caller or read
root-only files), with all resource limits, in a fresh temporary working
directory on the host file system; the audit hook then additionally refuses
process spawning (exec/posix_spawn/subprocess/os.system), ``ctypes`` and
``_posixsubprocess`` (whose ``fork_exec`` bypasses audit events), ``os.setsid``/``os.setpgid`` (so forked children stay in
the killable process group) and signals to processes outside the sandbox's
process group.  Audit hooks are an in-interpreter, best-effort barrier, not a
security boundary: without namespaces a determined program may still find a
way to the network.  When the caller is not root the code runs as the
caller's own user.

The interpreter is resolved once at import (:data:`SANDBOX_PYTHON`, reason in
:data:`SANDBOX_PYTHON_REASON`): a system ``python3`` that the unprivileged user
can execute (a virtualenv under ``/root`` cannot be used after the privilege
drop), falling back to ``sys.executable``.  Linux only.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from components.envs.sandbox_host import _NOBODY_GID, _NOBODY_UID, SANDBOX_PYTHON, SANDBOX_PYTHON_REASON
from components.envs.sandbox_rootfs import rootfs_plan
from components.envs.sandbox_proc import (
    _pidfd_open,
    _wait_exit_nowait,
    _read_available,
    _parse_status,
    _kill_sandbox,
    _kill_group,
)

__all__ = [
    "SandboxError",
    "SandboxResult",
    "run_python",
    "SANDBOX_PYTHON",
    "SANDBOX_PYTHON_REASON",
]

MiB = 1024 * 1024

#: RLIMIT_NOFILE inside the sandbox.
MAX_OPEN_FILES = 64
#: Each private tmpfs (/tmp, /var/tmp, /dev/shm, workdir) is at least this big.
MIN_TMPFS_BYTES = 16 * MiB
#: Minimal environment of the child (HOME is added per call).
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}
_UNSHARE_FLAGS = ("--net", "--pid", "--fork", "--mount", "--kill-child")
_STDERR_TAIL_BYTES = 4096
#: RAM-backed base for the per-call host directory in namespace mode.
_FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (host problem, not the code)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one :func:`run_python` call.

    ``exit_code`` is the program's exit status (negative: killed by that
    signal) or ``None`` when the sandbox killed it at the wall-clock deadline.
    ``timed_out`` is also set when the CPU-time limit (SIGXCPU) stopped it.
    ``memory_exceeded`` is a heuristic: ``MemoryError``, ``Cannot allocate
    memory`` (ENOMEM) or ``std::bad_alloc`` in the head or tail of stderr.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    memory_exceeded: bool
    output_truncated: bool = False
    isolation: str = ""
    wall_s: float = 0.0


# --------------------------------------------------------------------------
# Namespace support (probed once, lazily)
# --------------------------------------------------------------------------

_probe_lock = threading.Lock()
_probe_result: tuple[bool, str, str | None] | None = None
_warned = False


def _namespace_support() -> tuple[bool, str, str | None]:
    """(available, reason, unshare_path), probed once per process."""
    global _probe_result
    with _probe_lock:
        if _probe_result is not None:
            return _probe_result
        if os.geteuid() != 0:
            result = (False, "caller is not root (unshare --net needs CAP_SYS_ADMIN)", None)
        else:
            unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
            if unshare is None:
                result = (False, "unshare(1) not found", None)
            else:
                true = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
                try:
                    proc = subprocess.run(
                        [unshare, *_UNSHARE_FLAGS, "--", true],
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        timeout=10,
                        env=dict(_BASE_ENV),
                    )
                    if proc.returncode == 0:
                        result = (True, "unshare probe succeeded", unshare)
                    else:
                        err = proc.stderr.decode(errors="replace").strip()
                        result = (False, f"unshare probe failed (rc={proc.returncode}): {err}", None)
                except (OSError, subprocess.SubprocessError) as exc:
                    result = (False, f"unshare probe failed: {exc!r}", None)
        _probe_result = result
        return result


def _warn_degraded(reason: str) -> None:
    global _warned
    with _probe_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        "SAO sandbox is DEGRADED: no network/PID/mount namespaces "
        f"({reason}); network access is blocked only by a best-effort audit hook",
        RuntimeWarning,
        stacklevel=3,
    )


_warned_about: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    with _probe_lock:
        if key in _warned_about:
            return
        _warned_about.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------
# Bootstrap (runs inside the child; passed with -c, so nothing the sandboxed
# user can write is ever executed with privileges)
# --------------------------------------------------------------------------

# The child side lives in sandbox_child.py; its text is passed with -c.
# sandbox_seal.py (the sealed root and the seccomp filter) comes first: the child calls its functions.
_BOOTSTRAP = Path(__file__).with_name("sandbox_seal.py").read_text() + "\n" + \
    Path(__file__).with_name("sandbox_child.py").read_text()


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def run_python(
    code: str,
    timeout_s: float = 5.0,
    *,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    max_file_bytes: int = 8 * MiB,
    max_processes: int = 16,
) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh sandboxed subprocess.

    Args:
        code: program source (what ``python main.py`` would run).
        timeout_s: wall-clock limit in seconds (the CPU-time limit is
            ``ceil(timeout_s) + 1``).
        memory_mb: address-space limit (RLIMIT_AS) in MiB, >= 32.
        max_output_bytes: bytes of stdout and of stderr returned (each).
        max_file_bytes: largest file the program may write (RLIMIT_FSIZE);
            this also bounds what it can print.
        max_processes: RLIMIT_NPROC for the program.

    Returns:
        SandboxResult.  Never raises because of what the code does.

    Raises:
        ValueError: bad argument (the message names it).
        SandboxError: the sandbox could not be set up on this host.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    _check_int("memory_mb", memory_mb, 32)
    _check_int("max_output_bytes", max_output_bytes, 0)
    _check_int("max_file_bytes", max_file_bytes, 0)
    _check_int("max_processes", max_processes, 1)

    use_ns, ns_reason, unshare = _namespace_support()
    if not use_ns:
        _warn_degraded(ns_reason)
    is_root = os.geteuid() == 0
    uid, gid = (_NOBODY_UID, _NOBODY_GID) if is_root else (os.getuid(), os.getgid())
    python = SANDBOX_PYTHON
    if use_ns:
        try:
            plan, plan_report = rootfs_plan(python)
        except OSError as exc:
            raise SandboxError(f"cannot plan the sandbox's root file system: {exc}") from exc
    tmpfs_bytes = max(MIN_TMPFS_BYTES, 2 * max_file_bytes)

    start = time.monotonic()
    # With namespaces the program never writes to the host directory (its
    # workdir is a private tmpfs), so a RAM-backed base is safe and fast.
    top = tempfile.mkdtemp(prefix="sao-sandbox-", dir=_FAST_TMP if use_ns else None)
    fds: list[int] = []
    try:
        os.chmod(top, 0o711)  # traversable (for the workdir), not listable
        src_path = os.path.join(top, "main.py")
        fd = os.open(src_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as f:
            f.write(code.encode("utf-8", "surrogatepass"))
        work = os.path.join(top, "work")
        os.mkdir(work, 0o700)
        if is_root and not use_ns:
            os.chown(work, uid, gid)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        out_fd = os.open(os.path.join(top, "stdout"), flags, 0o600)
        fds.append(out_fd)
        err_fd = os.open(os.path.join(top, "stderr"), flags, 0o600)
        fds.append(err_fd)
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]

        argv = [python, "-I", "-S", "-B", "-X", "utf8", "-c", _BOOTSTRAP]
        argv += ["ns" if use_ns else "plain", src_path, work, str(status_w)]
        argv += [str(v) for v in (
            uid, gid, min(memory_mb * MiB, 2**62), min(max(1, math.ceil(timeout_s)) + 1, 2**31),
            min(max_file_bytes, 2**62),
            max_processes, MAX_OPEN_FILES, tmpfs_bytes, os.getpid(),
        )]
        argv += [plan, plan_report] if use_ns else ["{}", ""]
        if use_ns:
            assert unshare is not None
            argv = [unshare, *_UNSHARE_FLAGS, "--", *argv]
        env = dict(_BASE_ENV, HOME=work)

        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=err_fd,
                cwd=top,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(status_w,),
            )
        except OSError as exc:
            raise SandboxError(f"cannot start sandbox process {argv[0]!r}: {exc}") from exc
        os.close(status_w)
        fds.remove(status_w)
        try:
            import resource

            resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))
        except (ImportError, OSError, ValueError):
            pass

        timed_out = False
        status = bytearray()
        pidfd = _pidfd_open(proc.pid)
        try:
            remaining = timeout_s - (time.monotonic() - start)
            if not _wait_exit_nowait(proc.pid, pidfd, max(0.0, remaining)):
                timed_out = True
                _kill_sandbox(proc, pidfd, use_ns, status_r, status)
            else:
                # Sweep the group while the exited (zombie) leader still
                # reserves the pgid, then reap the leader.
                _kill_group(proc.pid)
                proc.wait()
        except BaseException:  # e.g. KeyboardInterrupt in the caller
            if proc.returncode is None:
                _kill_sandbox(proc, pidfd, use_ns, status_r, status)
            raise
        finally:
            if pidfd is not None:
                os.close(pidfd)
        wall_s = time.monotonic() - start
        _read_available(status_r, status)
        report, status_exit, _ = _parse_status(bytes(status))

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

        if report is None and not timed_out:
            raise SandboxError(
                "sandbox setup failed (exit status "
                f"{proc.returncode}): {(stderr_b + err_tail).decode(errors='replace').strip()}"
            )

        if timed_out:
            exit_code = None
        else:
            exit_code = status_exit if status_exit is not None else proc.returncode
        if exit_code == -signal.SIGXCPU:
            timed_out = True

        err_text = stderr_b + err_tail
        memory_exceeded = any(
            marker in err_text for marker in (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc")
        )
        if report is not None and "NO-SECCOMP" in report:
            _warn_once("no-seccomp", f"SAO sandbox runs WITHOUT its seccomp filter: {report}")
        if use_ns:
            isolation = f"namespaces(net,pid,mount);{report or 'killed-before-ready'}"
        else:
            isolation = f"DEGRADED(no namespaces: {ns_reason});{report or 'killed-before-ready'}"
        return SandboxResult(
            stdout=stdout_b.decode("utf-8", "replace"),
            stderr=stderr_b.decode("utf-8", "replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            memory_exceeded=memory_exceeded,
            output_truncated=truncated,
            isolation=isolation,
            wall_s=wall_s,
        )
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        _rmtree(top)


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

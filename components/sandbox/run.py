"""Run untrusted, model-generated Python code in a throw-away sandbox.

``run_python(code)`` runs ``code`` as a program in a fresh sandbox and returns a frozen :class:`SandboxResult`.
It never raises because of what the code does; it raises ``ValueError`` for bad arguments and
:class:`SandboxError` only when the sandbox itself fails (a host problem, never the code's doing). Calls may
run concurrently from many threads. ``docs/sandbox.md`` has the design, each layer's test and the costs.

Two ways to start a sandbox, with the same layers:

- **zygote** (when the caller is root and ``unshare`` works; ``zygote.py``): a pre-started interpreter
  per host process, already inside the sealed read-only root, forks one sandbox per call. ``isolation`` then
  includes ``zygote``.
- **per call** (``percall.py``): a fresh interpreter per call under ``unshare``, which seals the root
  itself. Used without namespaces (degraded, below), when the zygote cannot start (a ``RuntimeWarning``
  once), or when forced: ``ZYGOTE = False`` or ``SAO_SANDBOX_ZYGOTE=0`` in the environment.

Layers (``isolation`` lists those applied to each call):

1. **Namespaces and a sealed root** -- each call has its own network namespace (a downed loopback: no network,
   not even the host's 127.0.0.1 or another call's abstract unix sockets), PID namespace (it sees and signals
   no other process; everything it leaves behind dies with it) and mount namespace whose root is a minimal
   read-only tmpfs (``seal.py``): the interpreter, its standard library and the libraries they load,
   ``/dev/{null,zero,random,urandom}``, its own ``/proc`` (``/proc/sys`` read-only) and size-limited tmpfs
   ``/tmp``, ``/var/tmp``, ``/dev/shm`` and working directory; the host's root is detached (``pivot_root``).
   Of site-packages it holds only the allowed ``packages`` (``packages.py``: numpy and sympy by default, with
   what they require, such as mpmath), read-only under ``/opt/sao-packages``, which ends the program's
   ``sys.path``.
2. **Unprivileged user** -- ``nobody`` (verified irreversible) and ``PR_SET_NO_NEW_PRIVS``.
3. **Resource limits** on the program: RLIMIT_CPU (about the timeout), RLIMIT_AS (``memory_mb``),
   RLIMIT_FSIZE (``max_file_bytes``), RLIMIT_NPROC (``max_processes``; it counts all processes of ``nobody``
   on the host), RLIMIT_NOFILE (64), RLIMIT_CORE 0.
4. **Wall-clock deadline and supervision** -- the program runs under a supervisor (the PID namespace's init;
   without namespaces a subreaper) that reaps orphans, reports its exit status and kills what is left. At the
   deadline the init is SIGKILLed (the kernel kills the whole namespace), or without namespaces the
   supervisor kills the program's tree; ``timed_out`` is set. A call returns only after every process of it
   is gone and reaped (zombies would count against RLIMIT_NPROC).
5. **Scrubbed environment and interpreter flags** -- only PATH, LANG, LC_ALL, HOME (= the working directory),
   PYTHONDONTWRITEBYTECODE, PYTHONIOENCODING and one thread each for OpenBLAS, OpenMP and MKL (a BLAS thread
   pool reserves address space per thread, against RLIMIT_AS); ``-I -S -B -X utf8``. The program arrives in a
   file (a memfd for the zygote), never on a command line.
6. **Seccomp filter** (``seal.install_seccomp``): EPERM for namespaces, mounts, chroot, ptrace and
   other processes' memory, keyctl, bpf, io_uring, kexec, modules, SysV IPC and POSIX message queues,
   non-default personality and sockets of any family but AF_UNIX; another ABI kills the process. Without a
   syscall table for the architecture the result says ``NO-SECCOMP(...)`` (``RuntimeWarning`` once).
7. **Audit hook** (a third layer): refuses non-UNIX sockets and connect/bind/sendto/sendmsg/DNS from Python.
8. **Bounded output** -- stdout/stderr go to files the program cannot see, bounded by RLIMIT_FSIZE; only the
   first ``max_output_bytes`` of each are read back (``output_truncated``).

Degradation (loud: a ``RuntimeWarning`` once per process and ``DEGRADED`` in ``isolation``): when the caller
is not root, or ``unshare`` is missing or fails, no namespaces and no tmpfs are used. The code then still runs
as ``nobody`` if the caller is root, with all resource limits, in a fresh temporary working directory on the
host file system; the audit hook then also refuses spawning programs, ``ctypes``, ``os.setsid``/``setpgid``
and signals to processes outside the sandbox's process group. Audit hooks are a best-effort barrier, not a
security boundary. When the caller is not root the code runs as the caller's own user. The allowed packages are
found through the host directories that hold them, so everything else installed there is importable too.

The interpreter is resolved once at import (:data:`SANDBOX_PYTHON`, reason in :data:`SANDBOX_PYTHON_REASON`):
a system ``python3`` that the unprivileged user can execute, falling back to ``sys.executable``. Linux only.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import threading
import warnings
from dataclasses import dataclass

from components.sandbox.host import (
    _NOBODY_GID,
    _NOBODY_UID,
    SANDBOX_PYTHON,
    SANDBOX_PYTHON_REASON,
)
from components.sandbox.packages import PACKAGES_ROOT, resolve_packages
from components.sandbox.percall import run_percall
from components.sandbox.proc import Call, Outcome, SandboxError
from components.sandbox.rootfs import rootfs_plan
from components.sandbox.zygote import ZygoteUnavailable, run_in_zygote

__all__ = [
    "DEFAULT_PACKAGES",
    "SandboxError",
    "SandboxResult",
    "degraded_reason",
    "run_python",
    "SANDBOX_PYTHON",
    "SANDBOX_PYTHON_REASON",
]

MiB = 1024 * 1024

#: RLIMIT_NOFILE inside the sandbox.
MAX_OPEN_FILES = 64
#: Each private tmpfs (/tmp, /var/tmp, /dev/shm, workdir) is at least this big.
MIN_TMPFS_BYTES = 16 * MiB
#: Top-level import names a program may import by default (with what they require): what tool-integrated
#: reasoning traces use.
DEFAULT_PACKAGES: tuple[str, ...] = ("numpy", "sympy")
#: Fork each namespaced sandbox from a pre-started zygote (False: a fresh interpreter per call).
ZYGOTE = os.environ.get("SAO_SANDBOX_ZYGOTE", "1") != "0"
#: Minimal environment of the child (HOME is added per call).
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_UNSHARE_FLAGS = ("--net", "--pid", "--fork", "--mount", "--kill-child")
#: RAM-backed base for the per-call host directory in namespace mode.
_FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None


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


def degraded_reason() -> str | None:
    """Why every call of this process runs degraded (no namespaces: the reason ``isolation`` and the warning give),
    or None when calls run in namespaces. Probes once per process (``unshare ... true``), as the first call does."""
    available, reason, _ = _namespace_support()
    return None if available else reason


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
# Public API
# --------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_packages(packages: object) -> tuple[str, ...]:
    if not isinstance(packages, tuple) or not all(isinstance(name, str) for name in packages):
        raise ValueError(f"packages must be a tuple of str, got {packages!r}")
    for name in packages:
        if not name.isidentifier():
            raise ValueError(f"packages: {name!r} is not a top-level import name")
    return tuple(sorted(set(packages)))  # one plan (and one zygote) per set of names


def _check_program(code: object, timeout_s: object) -> None:
    """`ValueError` naming `code` or `timeout_s` when it is not a program text or a finite positive number."""
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")


def run_python(
    code: str,
    timeout_s: float = 5.0,
    *,
    memory_mb: int = 256,
    max_output_bytes: int = 64_000,
    max_file_bytes: int = 8 * MiB,
    max_processes: int = 16,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
) -> SandboxResult:
    """Run ``code`` as a Python program in a fresh sandbox.

    Args:
        code: program source (what ``python main.py`` would run).
        timeout_s: wall-clock limit in seconds (the CPU-time limit is
            ``ceil(timeout_s) + 1``).
        memory_mb: address-space limit (RLIMIT_AS) in MiB, >= 32.
        max_output_bytes: bytes of stdout and of stderr returned (each).
        max_file_bytes: largest file the program may write (RLIMIT_FSIZE);
            this also bounds what it can print.
        max_processes: RLIMIT_NPROC for the program.
        packages: top-level import names the program may import, besides the standard library (with the
            distributions they require); each must be installed for the sandbox's interpreter
            (:data:`SANDBOX_PYTHON`) or in the caller's compatible virtual environment. ``()``: none.

    Returns:
        SandboxResult.  Never raises because of what the code does.

    Raises:
        ValueError: bad argument (the message names it), or a package that is not installed.
        SandboxError: the sandbox could not be set up on this host.
    """
    _check_program(code, timeout_s)
    _check_int("memory_mb", memory_mb, 32)
    _check_int("max_output_bytes", max_output_bytes, 0)
    _check_int("max_file_bytes", max_file_bytes, 0)
    _check_int("max_processes", max_processes, 1)
    packages = _check_packages(packages)

    # The degraded and zygote warnings are raised here, not in a helper: their stacklevel (3) names the caller.
    use_ns, ns_reason, unshare = _namespace_support()
    if not use_ns:
        _warn_degraded(ns_reason)
    call = _plan_call(packages, use_ns, timeout_s, memory_mb, max_output_bytes, max_file_bytes, max_processes)
    outcome = None
    if use_ns and ZYGOTE:
        assert unshare is not None and call.plan is not None
        try:
            outcome = run_in_zygote(code, timeout_s, call, unshare)
        except ZygoteUnavailable as exc:
            _warn_once("zygote", f"SAO sandbox zygote unavailable ({exc}); starting one interpreter per call")
    if outcome is None:
        outcome = run_percall(code, timeout_s, call, unshare if use_ns else None)
    return _result(outcome, use_ns, ns_reason)


def _plan_call(
    packages: tuple[str, ...],
    use_ns: bool,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    max_file_bytes: int,
    max_processes: int,
) -> Call:
    """What both launchers run this call with (its user, root, `sys.path` and limits), from checked arguments.

    `ValueError` names a package that is not installed; `SandboxError` when the root cannot be planned."""
    is_root = os.geteuid() == 0
    uid, gid = (_NOBODY_UID, _NOBODY_GID) if is_root else (os.getuid(), os.getgid())
    python = SANDBOX_PYTHON
    plan = None
    try:
        allowed = resolve_packages(python, packages)  # ValueError naming a package that is not installed
        if use_ns:
            plan = rootfs_plan(python, packages)
    except OSError as exc:
        raise SandboxError(f"cannot plan the sandbox's root file system: {exc}") from exc
    if not packages:
        sys_path: tuple[str, ...] = ()
    else:
        sys_path = (PACKAGES_ROOT,) if use_ns else allowed.homes()
    return Call(
        python=python,
        plan=plan,
        sys_path=sys_path,
        uid=uid,
        gid=gid,
        env=_BASE_ENV,
        host_dir=_FAST_TMP if use_ns else None,
        limits=(
            min(memory_mb * MiB, 2**62),
            min(max(1, math.ceil(timeout_s)) + 1, 2**31),
            min(max_file_bytes, 2**62),
            max_processes,
            MAX_OPEN_FILES,
        ),
        tmpfs_bytes=max(MIN_TMPFS_BYTES, 2 * max_file_bytes),
        max_output_bytes=max_output_bytes,
        max_file_bytes=max_file_bytes,
    )


def _result(outcome: Outcome, use_ns: bool, ns_reason: str) -> SandboxResult:
    report, timed_out = outcome.report, outcome.timed_out
    if report is None and not timed_out:
        raise SandboxError(
            "sandbox setup failed (exit status "
            f"{outcome.returncode}): {(outcome.stderr + outcome.stderr_tail).decode(errors='replace').strip()}"
        )
    if timed_out:
        exit_code = None
    else:
        exit_code = outcome.status_exit if outcome.status_exit is not None else outcome.returncode
    if exit_code == -signal.SIGXCPU:
        timed_out = True
    err_text = outcome.stderr + outcome.stderr_tail
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
        stdout=outcome.stdout.decode("utf-8", "replace"),
        stderr=outcome.stderr.decode("utf-8", "replace"),
        exit_code=exit_code,
        timed_out=timed_out,
        memory_exceeded=memory_exceeded,
        output_truncated=outcome.truncated,
        isolation=isolation,
        wall_s=outcome.wall_s,
    )

"""Tests for components.sandbox.run.run_python (hostile programs included).

Most hostile-program checks need root (privilege drop to ``nobody`` and
namespaces); they are skipped when the tests do not run as root.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import subprocess
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from components.sandbox import run as sandbox
from components.sandbox.run import SandboxResult, run_python

IS_ROOT = os.geteuid() == 0
NS_AVAILABLE = sandbox._namespace_support()[0]
NOBODY_UID = sandbox._NOBODY_UID
REPO_ROOT = Path(__file__).resolve().parents[2]
SLACK_S = 2.0  # a timed-out call must return within timeout + SLACK_S

needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (privilege drop to nobody)")
needs_ns = pytest.mark.skipif(not NS_AVAILABLE, reason="namespaces (unshare) unavailable")


def _processes_of(uid: int) -> set[int]:
    """Processes (zombies included: they count against RLIMIT_NPROC) of ``uid``."""
    pids = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            pids.add(int(name))
    return pids


@pytest.fixture
def degraded(monkeypatch):
    """Force the no-namespace fallback (audit-hook network blocking)."""
    monkeypatch.setattr(sandbox, "_namespace_support", lambda: (False, "forced by test", None))
    monkeypatch.setattr(sandbox, "_warned", False)


# --------------------------------------------------------------------------
# Ordinary behaviour
# --------------------------------------------------------------------------


def test_normal_program():
    r = run_python("print(37*12+5)", 5)
    assert isinstance(r, SandboxResult)
    assert (r.stdout, r.exit_code, r.timed_out, r.memory_exceeded) == ("449\n", 0, False, False)
    assert r.stderr == ""
    assert not r.output_truncated
    assert r.wall_s < 5


def test_result_is_frozen():
    r = run_python("print(1)", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.stdout = "x"  # type: ignore[misc]


def test_syntax_error():
    r = run_python("print(", 5)
    assert r.exit_code not in (0, None)
    assert "SyntaxError" in r.stderr
    assert "<string>" not in r.stderr  # the bootstrap's frame is hidden
    assert not r.timed_out


def test_exception_traceback_and_exit_builtins():
    r = run_python("def f():\n    1/0\nf()", 5)
    assert r.exit_code == 1
    assert "ZeroDivisionError" in r.stderr and "line 2, in f" in r.stderr
    # exit()/quit() exist although site is not imported (-S)
    assert run_python("print('a'); exit(3)", 5).exit_code == 3
    assert run_python("import sys; sys.exit(4)", 5).exit_code == 4


def test_unicode_stdin_and_stderr():
    r = run_python(
        "import sys\nprint('héllo ✓')\nprint('warn', file=sys.stderr)\n"
        "try:\n    input()\nexcept EOFError:\n    print('eof')",
        5,
    )
    assert r.stdout == "héllo ✓\neof\n"
    assert r.stderr == "warn\n"


def test_asyncio_and_multiprocessing_still_work():
    code = textwrap.dedent(
        """
        import asyncio, multiprocessing
        async def f():
            return 7
        print(asyncio.run(f()))
        with multiprocessing.Pool(2) as pool:
            print(sum(pool.map(abs, [-1, -2, -3])))
        """
    )
    r = run_python(code, 10)
    assert r.stdout == "7\n6\n", r.stderr


def test_fresh_workdir_removed_afterwards():
    code = "import os\nopen('f.txt', 'w').write('1')\nprint(os.getcwd())\nprint(os.listdir('.'))"
    r1 = run_python(code, 5)
    r2 = run_python(code, 5)
    cwd1, cwd2 = r1.stdout.splitlines()[0], r2.stdout.splitlines()[0]
    assert cwd1 != cwd2
    # Each run sees only its own files (the program is main.py).
    assert sorted(eval(r2.stdout.splitlines()[1])) == ["f.txt", "main.py"]
    assert not os.path.exists(cwd1) and not os.path.exists(cwd2)
    r3 = run_python("import os; print(os.environ['HOME'] == os.getcwd())", 5)
    assert r3.stdout == "True\n"


def test_minimal_environment():
    r = run_python("import os; print(sorted(os.environ))", 5)
    assert set(eval(r.stdout)) <= {
        "PATH",
        "LANG",
        "LC_ALL",
        "HOME",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONIOENCODING",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }


@needs_root
def test_runs_as_nobody_with_limits():
    code = textwrap.dedent(
        """
        import os, resource as R
        print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
        for name in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NPROC', 'RLIMIT_NOFILE', 'RLIMIT_CORE'):
            print(name, R.getrlimit(getattr(R, name))[0])
        """
    )
    r = run_python(code, 3, memory_mb=300, max_file_bytes=12345, max_processes=7)
    lines = r.stdout.splitlines()
    assert lines[0] == f"{NOBODY_UID} {NOBODY_UID} {sandbox._NOBODY_GID} []"
    limits = dict(line.split() for line in lines[1:])
    assert limits == {
        "RLIMIT_CPU": "4",
        "RLIMIT_AS": str(300 * 1024 * 1024),
        "RLIMIT_FSIZE": "12345",
        "RLIMIT_NPROC": "7",
        "RLIMIT_NOFILE": str(sandbox.MAX_OPEN_FILES),
        "RLIMIT_CORE": "0",
    }
    assert f"user={NOBODY_UID}" in r.isolation


@needs_ns
def test_namespaces_applied():
    with tempfile.NamedTemporaryFile(dir="/tmp") as host_tmp, tempfile.NamedTemporaryFile(dir="/dev/shm") as host_shm:
        r = run_python(
            "import os\nprint(os.getpid(), os.getppid())\n"
            "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
            f"print(os.path.exists({host_tmp.name!r}), os.path.exists({host_shm.name!r}))",
            5,
        )
    pid_line, procs, tmp = r.stdout.splitlines()
    assert pid_line == "2 1"  # pid 2 under the namespace's init
    assert eval(procs) == ["1", "2"]  # nothing of the host is visible
    assert tmp == "False False"  # private tmpfs over /tmp and /dev/shm
    assert r.isolation.startswith("namespaces(net,pid,mount)")
    assert "tmpfs=/tmp" in r.isolation and "no_new_privs" in r.isolation


def test_interpreter_resolved_for_unprivileged_user():
    assert os.path.isabs(sandbox.SANDBOX_PYTHON)
    if os.path.exists("/usr/bin/python3"):
        assert sandbox.SANDBOX_PYTHON == "/usr/bin/python3"
        assert "/usr/bin/python3" in sandbox.SANDBOX_PYTHON_REASON


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"code": b"print(1)"}, "code"),
        ({"code": None}, "code"),
        ({"code": "1", "timeout_s": 0}, "timeout_s"),
        ({"code": "1", "timeout_s": -1.0}, "timeout_s"),
        ({"code": "1", "timeout_s": float("nan")}, "timeout_s"),
        ({"code": "1", "timeout_s": "5"}, "timeout_s"),
        ({"code": "1", "timeout_s": True}, "timeout_s"),
        ({"code": "1", "memory_mb": 4}, "memory_mb"),
        ({"code": "1", "memory_mb": 256.0}, "memory_mb"),
        ({"code": "1", "max_output_bytes": -1}, "max_output_bytes"),
        ({"code": "1", "max_file_bytes": -5}, "max_file_bytes"),
        ({"code": "1", "max_processes": 0}, "max_processes"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        run_python(**kwargs)


# --------------------------------------------------------------------------
# Hostile programs
# --------------------------------------------------------------------------


def _timed_out(r):
    assert r.timed_out and r.exit_code is None, r


def _finished_quickly_with(text):
    def check(r):
        assert not r.timed_out, r
        assert text in r.stdout, r

    return check


def _memory_exceeded(r):
    assert r.memory_exceeded and not r.timed_out, r
    assert r.exit_code not in (0, None)
    assert "MemoryError" in r.stderr


def _huge_output_bounded(r):
    assert len(r.stdout.encode()) <= 10_000 and r.output_truncated, r
    assert r.stdout.startswith("x" * 100)
    assert r.timed_out or r.exit_code != 0  # stopped by RLIMIT_FSIZE or the deadline


def _disk_fill_stopped(r):
    assert r.exit_code not in (0, None), r
    assert "File too large" in r.stderr, r.stderr


def _stderr_has(*names):
    def check(r):
        assert r.exit_code not in (0, None), r
        assert any(n in r.stderr for n in names), r.stderr

    return check


def _outside_write_failed(r):
    assert r.exit_code not in (0, None)
    assert "PermissionError" in r.stderr or "Read-only" in r.stderr, r.stderr
    assert not (REPO_ROOT / "PWNED").exists()
    assert not Path("/etc/pwned").exists()


def _survived(r):
    # The call returned normally, so the caller (this test process) is alive.
    assert not r.timed_out and r.exit_code is not None, r
    assert not r.memory_exceeded


HOSTILE = [
    # Infinite CPU loop: killed at the wall-clock deadline.
    pytest.param("while True: pass", 1.0, {}, _timed_out, id="infinite-loop"),
    # Sleeping past the deadline (no CPU use, so only the wall clock stops it).
    pytest.param("import time; time.sleep(60)", 1.0, {}, _timed_out, id="sleep-past-deadline"),
    # Fork bomb: RLIMIT_NPROC caps it, the deadline kills the whole group.
    pytest.param(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        1.5,
        {},
        _timed_out,
        id="fork-bomb",
    ),
    # Daemonised child (fork + setsid escapes the process group); the parent
    # exits at once.  It must not survive the call.
    pytest.param(
        "import os, time\nif os.fork() == 0:\n    try:\n        os.setsid()\n    except Exception:\n"
        "        pass\n    time.sleep(60)\nprint('parent done')",
        3.0,
        {},
        _finished_quickly_with("parent done"),
        id="daemonized-child",
    ),
    # One huge allocation: RLIMIT_AS -> MemoryError.
    pytest.param("x = bytearray(10**10)", 5.0, {}, _memory_exceeded, id="memory-bomb-bytearray"),
    # Growing list of 1 MB strings until the address-space limit.
    pytest.param(
        "l = []\nwhile True:\n    l.append(' ' * 10**6)",
        5.0,
        {},
        _memory_exceeded,
        id="memory-bomb-list",
    ),
    # Endless output: bounded by RLIMIT_FSIZE on the output file, only
    # max_output_bytes come back.
    pytest.param(
        "while True:\n    print('x' * 10000)",
        3.0,
        {"max_output_bytes": 10_000},
        _huge_output_bounded,
        id="huge-output",
    ),
    # Filling the disk with a 1 GB file: RLIMIT_FSIZE stops it (EFBIG).
    pytest.param(
        "with open('big.bin', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)",
        5.0,
        {},
        _disk_fill_stopped,
        id="disk-fill",
    ),
    # Deep recursion: RecursionError is reported, nothing else happens.
    pytest.param(
        "def f(n):\n    return f(n + 1)\nf(0)",
        5.0,
        {},
        _stderr_has("RecursionError"),
        id="deep-recursion",
    ),
    # Writing outside the working directory (repository, /etc).
    pytest.param(
        f"import os\ntry:\n    open({str(REPO_ROOT / 'PWNED')!r}, 'w').write('x')\nexcept OSError as e:\n"
        "    print(e)\nopen('/etc/pwned', 'w').write('x')",
        5.0,
        {},
        _outside_write_failed,
        id="write-outside-workdir",
        marks=needs_root,
    ),
    # Reading root-only files.
    pytest.param(
        "print(open('/etc/shadow').read())",
        5.0,
        {},
        _stderr_has("PermissionError", "FileNotFoundError"),
        id="read-etc-shadow",
        marks=needs_root,
    ),
    pytest.param(
        "print(open('/root/.bashrc').read())",
        5.0,
        {},
        _stderr_has("PermissionError", "FileNotFoundError"),
        id="read-root-home",
        marks=needs_root,
    ),
    # Killing the parent and its process group, and everything it can see.
    pytest.param("import os; os.kill(os.getppid(), 9)", 5.0, {}, _survived, id="kill-parent"),
    pytest.param(
        "import os; os.killpg(os.getpgid(os.getppid()), 9)",
        5.0,
        {},
        _survived,
        id="killpg-parent",
    ),
    pytest.param("import os; os.kill(-1, 9); os.kill(0, 9)", 5.0, {}, _survived, id="kill-all"),
]


@needs_root
@pytest.mark.parametrize(("code", "timeout_s", "kwargs", "check"), HOSTILE)
def test_hostile_program_is_contained(code, timeout_s, kwargs, check):
    before = _processes_of(NOBODY_UID)
    t0 = time.monotonic()
    r = run_python(code, timeout_s, **kwargs)
    elapsed = time.monotonic() - t0
    check(r)
    assert elapsed < timeout_s + SLACK_S
    # Nothing the program started survives the call.
    assert _processes_of(NOBODY_UID) - before == set()


@needs_root
def test_huge_output_does_not_grow_caller_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", 3, max_file_bytes=200 * 2**20)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.output_truncated and len(r.stdout) == 64_000
    assert after - before < 50 * 1024  # KiB: the caller read at most max_output_bytes


def test_environment_secrets_not_visible(monkeypatch):
    secret = "sao-test-secret-8c1f0e"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == secret
    code = textwrap.dedent(
        """
        import os
        print(dict(os.environ))
        for pid in [p for p in os.listdir('/proc') if p.isdigit()] + [str(os.getppid())]:
            try:
                print(open('/proc/%s/environ' % pid, 'rb').read())
            except OSError as e:
                print('denied', pid, type(e).__name__)
        """
    )
    r = run_python(code, 5)
    assert r.exit_code == 0, r.stderr
    assert secret not in r.stdout and secret not in r.stderr
    assert "AWS_SECRET_ACCESS_KEY" not in r.stdout


def _network_probe_code(port: int) -> str:
    inner = (
        "import socket\n"
        f"try:\n    s = socket.socket()\n    s.settimeout(1)\n    s.connect(('127.0.0.1', {port}))\n"
        "    print('SUBPROC CONNECTED')\n"
        "except OSError as e:\n    print('SUBPROC FAILED', e.errno)"
    )
    return textwrap.dedent(
        f"""
        import socket, subprocess, sys
        try:
            socket.create_connection(('127.0.0.1', {port}), timeout=1)
            print('INPROC CONNECTED')
        except OSError as e:
            print('INPROC BLOCKED', type(e).__name__, e)
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b'x', ('8.8.8.8', 53))
            print('UDP SENT')
        except OSError as e:
            print('UDP BLOCKED', type(e).__name__)
        # Bypass the in-process audit hook with a fresh interpreter.
        try:
            out = subprocess.run([sys.executable, '-I', '-S', '-c', {inner!r}],
                                 capture_output=True, text=True, timeout=5)
            print(out.stdout.strip(), out.stderr.strip())
        except Exception as e:
            print('SUBPROC REFUSED', type(e).__name__)
        """
    )


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


def _assert_no_connection(srv):
    with pytest.raises(BlockingIOError):
        conn, _ = srv.accept()
        conn.close()


def test_network_connection_fails(listener):
    r = run_python(_network_probe_code(listener.getsockname()[1]), 8)
    assert "INPROC BLOCKED PermissionError" in r.stdout, r
    assert "UDP BLOCKED" in r.stdout
    assert "CONNECTED" not in r.stdout and "UDP SENT" not in r.stdout
    if NS_AVAILABLE:
        # The fresh interpreter has no audit hook: the seccomp filter refuses
        # its AF_INET socket (EPERM) before the network namespace (downed
        # loopback only) would.
        assert "SUBPROC FAILED 1" in r.stdout, r
    _assert_no_connection(listener)


@needs_root
def test_cannot_signal_callers_processes():
    sentinel = subprocess.Popen(["sleep", "30"])
    try:
        code = textwrap.dedent(
            f"""
            import os
            for target in ({sentinel.pid}, {os.getpid()}):
                try:
                    os.kill(target, 9)
                    print('KILLED', target)
                except OSError as e:
                    print('FAILED', target, type(e).__name__)
            """
        )
        r = run_python(code, 5)
        assert "KILLED" not in r.stdout, r
        assert r.stdout.count("FAILED") == 2
        assert sentinel.poll() is None  # still running
    finally:
        sentinel.kill()
        sentinel.wait()


# --------------------------------------------------------------------------
# Degraded mode (no namespaces): forced, so it is tested on this host too
# --------------------------------------------------------------------------


def test_degraded_mode_warns_and_still_isolates(degraded, listener):
    with pytest.warns(RuntimeWarning, match="DEGRADED"):
        r = run_python("print(37*12+5)", 5)
    assert r.stdout == "449\n" and r.exit_code == 0
    assert r.isolation.startswith("DEGRADED(no namespaces: forced by test)")
    assert "audit_hook(net,exec,ctypes,kill)" in r.isolation
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        r = run_python(_network_probe_code(listener.getsockname()[1]), 8)
    assert "INPROC BLOCKED PermissionError" in r.stdout, r
    assert "SUBPROC REFUSED PermissionError" in r.stdout, r
    assert "CONNECTED" not in r.stdout and "UDP SENT" not in r.stdout
    _assert_no_connection(listener)


@needs_root
def test_degraded_mode_hostile_programs(degraded):
    with pytest.warns(RuntimeWarning):
        r = run_python("import os; print(os.getuid())", 5)
    assert r.stdout == f"{NOBODY_UID}\n"
    before = _processes_of(NOBODY_UID)
    t0 = time.monotonic()
    r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 1)
    assert r.timed_out and time.monotonic() - t0 < 1 + SLACK_S
    r = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('done')", 3)
    assert r.stdout == "done\n" and not r.timed_out
    assert _processes_of(NOBODY_UID) - before == set()
    for code in (
        "import os; os.kill(os.getppid(), 9)",
        "import os; os.kill(-1, 9)",
        "import os; os.killpg(os.getpgid(os.getppid()), 9)",
    ):
        r = run_python(code, 5)
        assert r.exit_code == 1 and "PermissionError" in r.stderr, r
    r = run_python("import ctypes", 5)
    assert r.exit_code == 1
    r = run_python("print(open('/etc/shadow').read())", 5)
    assert "PermissionError" in r.stderr
    r = run_python("x = bytearray(10**10)", 5)
    assert r.memory_exceeded


def test_sandbox_error_when_interpreter_missing(monkeypatch):
    monkeypatch.setattr(sandbox, "SANDBOX_PYTHON", "/nonexistent/python3")
    with pytest.raises(sandbox.SandboxError):
        run_python("print(1)", 5)

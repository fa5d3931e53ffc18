"""Isolation between sandbox calls, and the zygote that forks them (components/sandbox/zygote.py).

Real processes only. Two calls run at the same time: the first (A) writes files, opens sockets and waits,
the second (B) looks for them. The host coordinates them from outside: A's readiness and the go-ahead are
files in A's own /tmp, which the host (root) reaches through /proc/<pid>/root of A's program process. Each
check also shows that the thing B looks for works inside one call (B's own abstract socket connects), so a
refusal across calls is the isolation, not a broken feature.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from components.sandbox import run as sandbox
from components.sandbox import zygote as sandbox_zygote
from components.sandbox.run import SandboxError, run_python
from components.sandbox.seal import _DENY, _SYSCALLS, seccomp_program

NS_AVAILABLE = sandbox._namespace_support()[0]
needs_zygote = pytest.mark.skipif(os.geteuid() != 0 or not NS_AVAILABLE, reason="the zygote needs root and unshare")
EPERM = 1
# bind/connect of AF_UNIX sockets with raw libc calls: the audit hook refuses them from Python code, but a
# program gets past it with ctypes or a fresh interpreter, so the namespaces are what must hold.
_RAW_UNIX = """
import ctypes, os, socket
_libc = ctypes.CDLL(None, use_errno=True)
def raw(op, sock, address):
    data = (1).to_bytes(2, 'little') + address.encode()  # sockaddr_un: AF_UNIX, then the path or '\\0name'
    if getattr(_libc, op)(sock.fileno(), ctypes.create_string_buffer(data, len(data)), len(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
"""


def _wait_for(predicate, timeout_s: float = 8.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _pid_with_file(path_in_sandbox: str) -> int | None:
    """The host pid of a sandboxed process whose root holds `path_in_sandbox`."""
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{name}").st_uid == sandbox._NOBODY_UID and os.path.exists(
                f"/proc/{name}/root{path_in_sandbox}"
            ):
                return int(name)
        except OSError:
            continue
    return None


def _pids_with_argument(token: str) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


class WaitingCall:
    """Call A: runs `setup`, announces itself with /tmp/ready-<token> (holding its cwd), waits for
    /tmp/go-<token>, then runs `after`. Started in a thread; `go()` releases it and returns its result."""

    def __init__(self, setup: str, after: str, timeout_s: float = 20.0) -> None:
        self.token = "sao-iso-" + secrets.token_hex(6)
        code = (
            textwrap.dedent(setup)
            + textwrap.dedent(f"""
            import os as _os, time as _time
            open('/tmp/ready-{self.token}', 'w').write(_os.getcwd())
            _deadline = _time.monotonic() + {timeout_s - 2}
            while not _os.path.exists('/tmp/go-{self.token}') and _time.monotonic() < _deadline:
                _time.sleep(0.01)
            """)
            + textwrap.dedent(after)
        )
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(code, timeout_s))
        self.thread.start()
        self.pid = _wait_for(
            lambda: self._check_alive() and _pid_with_file(f"/tmp/ready-{self.token}"), what="call A to start"
        )
        with open(f"/proc/{self.pid}/root/tmp/ready-{self.token}") as f:
            self.cwd = f.read()

    def _check_alive(self) -> bool:
        if not self.thread.is_alive():
            raise AssertionError(f"call A ended before it was ready: {self.result}")
        return True

    def _run(self, code: str, timeout_s: float) -> None:
        self.result = run_python(code, timeout_s)

    def go(self):
        open(f"/proc/{self.pid}/root/tmp/go-{self.token}", "w").close()
        self.thread.join(30)
        assert self.result is not None
        return self.result


# --------------------------------------------------------------------------
# Files, processes, sockets, IPC, the zygote's channel
# --------------------------------------------------------------------------


@needs_zygote
def test_concurrent_call_cannot_see_files_processes_or_sockets():
    a = WaitingCall(
        setup=_RAW_UNIX
        + textwrap.dedent("""
            secret = 'sesame-files'
            for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):
                open(d + '/secret.txt', 'w').write(secret)
            abstract = socket.socket(socket.AF_UNIX)
            raw('bind', abstract, '\\0sao-iso-abstract')
            abstract.listen(4)
            abstract.setblocking(False)
            named = socket.socket(socket.AF_UNIX)
            raw('bind', named, '/tmp/named.sock')
            named.listen(4)
            named.setblocking(False)
            """),
        after="""
            import json
            accepted = []
            for s in (abstract, named):
                try:
                    accepted.append(s.accept() is not None)
                except BlockingIOError:
                    accepted.append(False)
            intact = [open(d + '/secret.txt').read() == secret for d in ('/tmp', '/var/tmp', '/dev/shm', '.')]
            print(json.dumps({'accepted': accepted, 'intact': intact}))
            """,
    )
    probe = _RAW_UNIX + textwrap.dedent(f"""
        import json
        out = {{}}
        out['listing'] = {{d: sorted(os.listdir(d)) for d in ('/tmp', '/var/tmp', '/dev/shm', '.')}}
        out['visible'] = [os.path.exists(p) for p in ('/tmp/secret.txt', '/var/tmp/secret.txt',
                          '/dev/shm/secret.txt', {a.cwd + "/secret.txt"!r}, {a.cwd!r})]
        out['procs'] = sorted(p for p in os.listdir('/proc') if p.isdigit())
        try:
            os.kill({a.pid}, 0)
            out['kill'] = 'delivered'
        except OSError as e:
            out['kill'] = type(e).__name__
        for name, address in (('abstract', '\\0sao-iso-abstract'), ('named', '/tmp/named.sock')):
            try:
                raw('connect', socket.socket(socket.AF_UNIX), address)
                out[name] = 'connected'
            except OSError as e:
                out[name] = type(e).__name__
        own = socket.socket(socket.AF_UNIX)
        raw('bind', own, '\\0sao-iso-abstract')  # the same name is free in this call's network namespace
        own.listen(1)
        raw('connect', socket.socket(socket.AF_UNIX), '\\0sao-iso-abstract')
        out['own-abstract'] = own.accept() is not None
        print(json.dumps(out))
        """)
    b = run_python(probe, 10)
    result_a = a.go()
    seen = json.loads(b.stdout)
    # B sees only what is its own: an empty /tmp and /var/tmp, its own workdir under /dev/shm, its main.py
    listing = seen["listing"]
    assert (listing["/tmp"], listing["/var/tmp"], listing["."]) == ([], [], ["main.py"])
    assert len(listing["/dev/shm"]) == 1 and listing["/dev/shm"][0].startswith("sao-sandbox-")
    assert listing["/dev/shm"][0] not in a.cwd
    assert seen["visible"] == [False] * 5
    assert seen["procs"] == ["1", "2"]
    assert seen["kill"] == "ProcessLookupError"
    assert (seen["abstract"], seen["named"]) == ("ConnectionRefusedError", "FileNotFoundError")
    assert seen["own-abstract"] is True
    assert result_a.exit_code == 0, result_a.stderr
    assert json.loads(result_a.stdout) == {"accepted": [False, False], "intact": [True] * 4}


@needs_zygote
def test_sysv_ipc_and_message_queues_are_refused_even_for_the_hosts_objects():
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x5A0C0000 | secrets.randbelow(0xFFFF)
    shmid = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT, readable and writable by everyone
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        code = textwrap.dedent(f"""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            def call(name, *args):
                r = getattr(libc, name)(*args)
                return r if r >= 0 else -ctypes.get_errno()
            print(call('shmget', {key}, 0, 0), call('shmget', 0, 4096, 0o1000 | 0o600),
                  call('semget', 0, 1, 0o1000 | 0o600), call('msgget', 0, 0o1000 | 0o600),
                  call('mq_open', b'/sao-iso', 0o100 | 2, 0o600, None))
            """)
        r = run_python(code, 5)
        assert r.stdout.split() == [str(-EPERM)] * 5, r
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


@needs_zygote
def test_program_cannot_reach_the_zygotes_channel():
    code = textwrap.dedent("""
        import json, os, stat
        sockets = []
        for fd in range(1024):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    sockets.append(fd)
            except OSError:
                pass
        try:
            supervisor = os.listdir('/proc/1/fd')
        except OSError as e:
            supervisor = type(e).__name__
        print(json.dumps({'sockets': sockets, 'fds': sorted(int(f) for f in os.listdir('/proc/self/fd')),
                          'unix': open('/proc/net/unix').read().splitlines()[1:], 'supervisor': supervisor}))
        """)
    seen = json.loads(run_python(code, 5).stdout)
    # 0-2 are stdin/stdout/stderr, 3 is the listdir's own descriptor; no socket of any kind
    assert seen == {"sockets": [], "fds": [0, 1, 2, 3], "unix": [], "supervisor": "PermissionError"}


@needs_zygote
def test_concurrent_calls_each_see_only_their_own_files():
    code = textwrap.dedent("""
        import os, time
        token = {token!r}
        for d in ('/tmp', '/dev/shm', '.'):
            open(d + '/mine.txt', 'w').write(token)
        time.sleep(0.3)  # the others write theirs meanwhile
        print(' '.join(open(d + '/mine.txt').read() for d in ('/tmp', '/dev/shm', '.')))
        print(len(os.listdir('/tmp')), len(os.listdir('.')))
        """)
    tokens = [secrets.token_hex(4) for _ in range(8)]
    results: dict[str, object] = {}

    def one(token):
        results[token] = run_python(code.format(token=token), 10)

    threads = [threading.Thread(target=one, args=(t,)) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for token in tokens:
        assert results[token].stdout == f"{token} {token} {token}\n1 2\n", results[token]


# --------------------------------------------------------------------------
# Lifetime: leftovers, the zygote dying, forks of the host
# --------------------------------------------------------------------------


@needs_zygote
def test_leftover_background_process_is_dead_before_the_next_call():
    token = "sao-left-" + secrets.token_hex(6)
    code = textwrap.dedent(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])
            os._exit(0)
        print('parent done')
        """)
    r = run_python(code, 5)
    assert r.stdout == "parent done\n" and not r.timed_out
    assert _pids_with_argument(token) == []  # already gone when run_python returned
    assert run_python("print(2)", 5).stdout == "2\n"


@needs_zygote
def test_zygote_restarts_after_sigkill():
    assert run_python("print(1)", 5).stdout == "1\n"
    before = set(sandbox_zygote.zygote_pids())
    assert before
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: not set(sandbox_zygote.zygote_pids()) & before, what="the zygote to die")
    r = run_python("print(2)", 5)
    assert r.stdout == "2\n" and "zygote" in r.isolation
    after = set(sandbox_zygote.zygote_pids())
    assert after and not after & before


@needs_zygote
def test_call_in_flight_when_the_zygote_dies_raises_and_leaves_nothing():
    a_error: list[BaseException] = []
    token = "sao-inflight-" + secrets.token_hex(6)

    def call():
        try:
            run_python(f"open('/tmp/{token}', 'w').close()\nimport time\ntime.sleep(30)", 40)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            a_error.append(exc)

    thread = threading.Thread(target=call)
    start = time.monotonic()
    thread.start()
    program = _wait_for(lambda: _pid_with_file(f"/tmp/{token}"), what="the call to start")
    for pid in sandbox_zygote.zygote_pids():
        os.kill(pid, signal.SIGKILL)
    thread.join(20)
    assert time.monotonic() - start < 15  # not the program's 30 s
    assert len(a_error) == 1 and isinstance(a_error[0], SandboxError), a_error
    _wait_for(lambda: not os.path.exists(f"/proc/{program}"), 5, "the program to be gone")
    assert run_python("print(3)", 5).stdout == "3\n"


@needs_zygote
def test_forked_host_process_gets_its_own_zygote():
    assert run_python("print(1)", 5).stdout == "1\n"
    parents = set(sandbox_zygote.zygote_pids())
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked process
        try:
            inherited = set(sandbox_zygote.zygote_pids())  # the parent's zygotes are not this process's
            r = run_python("print(7)", 5)
            os.write(
                write_end,
                json.dumps(
                    {"inherited": sorted(inherited), "stdout": r.stdout, "mine": sandbox_zygote.zygote_pids()}
                ).encode(),
            )
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        seen = json.loads(f.read())
    os.waitpid(child, 0)
    assert seen["inherited"] == [] and seen["stdout"] == "7\n"
    assert len(seen["mine"]) == 1 and seen["mine"][0] not in parents
    # The child's zygote ends with the child (its channel closed); the parent's still serves the parent.
    _wait_for(lambda: not os.path.exists(f"/proc/{seen['mine'][0]}"), 10, "the child's zygote to end")
    assert set(sandbox_zygote.zygote_pids()) == parents
    assert run_python("print(8)", 5).stdout == "8\n"


# --------------------------------------------------------------------------
# The per-call path: forced, as a fallback, and as the reference for the zygote's behaviour
# --------------------------------------------------------------------------


@needs_zygote
def test_forced_per_call_path_still_works(monkeypatch):
    monkeypatch.setattr(sandbox, "ZYGOTE", False)
    r = run_python("import os; print(os.getpid(), os.getppid())", 5)
    assert r.stdout == "2 1\n"
    assert r.isolation.startswith("namespaces(net,pid,mount);") and "zygote" not in r.isolation
    assert "rootfs=minimal-ro" in r.isolation and "seccomp(" in r.isolation


@needs_zygote
def test_environment_variable_forces_the_per_call_path():
    code = "from components.sandbox.run import run_python\nprint(run_python('print(5)').isolation)"
    env = dict(os.environ, SAO_SANDBOX_ZYGOTE="0")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("namespaces(net,pid,mount);") and "zygote" not in out.stdout


@needs_zygote
def test_zygote_that_cannot_start_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(sandbox_zygote, "_STUB", "import sys; sys.exit(3)")  # a real interpreter that exits
    monkeypatch.setattr(sandbox_zygote, "_zygotes", {})
    monkeypatch.setattr(sandbox_zygote, "_unavailable", {})
    monkeypatch.setattr(sandbox, "_warned_about", set())
    with pytest.warns(RuntimeWarning, match="zygote unavailable"):
        r = run_python("print(6)", 5)
    assert r.stdout == "6\n" and "zygote" not in r.isolation
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only, and not started again
        assert run_python("print(6)", 5).stdout == "6\n"


EXIT_CASES = {
    "sys-exit-message": "import sys\nprint('out')\nsys.exit('bye')",
    "sys-exit-code": "raise SystemExit(300)",
    "atexit-and-del": (
        "import atexit\nclass A:\n    def __del__(self):\n        print('del')\n"
        "a = A()\natexit.register(lambda: print('atexit'))\nprint('main')"
    ),
    "unflushed-file-object": "import os\nf = os.fdopen(os.dup(1), 'w')\nf.write('buffered')",
    "non-daemon-thread": (
        "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), "
        "print('thread'))).start()\nprint('main')"
    ),
    "exception": "def f():\n    raise KeyError('k')\nf()",
    "stdout-closed": "import sys\nsys.stdout.close()",
}


@needs_zygote
@pytest.mark.parametrize("name", sorted(EXIT_CASES))
def test_zygote_exit_matches_a_fresh_interpreter(name, monkeypatch):
    """A sandbox forked from the zygote ends without the interpreter's full teardown; what a program can
    observe of its end (output, exit status) must be what a fresh interpreter gives (the per-call path)."""
    zygote = run_python(EXIT_CASES[name], 5)
    monkeypatch.setattr(sandbox, "ZYGOTE", False)
    fresh = run_python(EXIT_CASES[name], 5)
    assert "zygote" in zygote.isolation and "zygote" not in fresh.isolation

    def observed(r):  # each call has its own randomly named working directory
        return [re.sub(r"sao-sandbox-\w+", "sao-sandbox-*", text) for text in (r.stdout, r.stderr)], r.exit_code

    assert observed(zygote) == observed(fresh)


# --------------------------------------------------------------------------
# The seccomp program against a reference interpreter of classic BPF
# --------------------------------------------------------------------------


def _run_bpf(prog, nr: int, arch: int, arg0: int = 0) -> int:
    """A slow, obviously-correct classic BPF interpreter (only the instructions the filter uses)."""
    data = {0: nr & 0xFFFFFFFF, 4: arch, 16: arg0 & 0xFFFFFFFF}
    a, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            a = data.get(k, 0)
            pc += 1
        elif code == 0x15:
            pc += 1 + (jt if a == k else jf)
        elif code == 0x35:
            pc += 1 + (jt if a >= k else jf)
        elif code == 0x45:
            pc += 1 + (jt if a & k else jf)
        elif code == 0x05:
            pc += 1 + k
        elif code == 0x06:
            return k
        else:
            raise ValueError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", sorted(_SYSCALLS))
def test_seccomp_denies_exactly_its_table_including_every_ipc_call(machine):
    arch, numbers = _SYSCALLS[machine]
    prog = seccomp_program(machine)
    denied = {numbers[name] for name in _DENY}
    ipc = {
        "shmget",
        "shmat",
        "shmctl",
        "shmdt",
        "semget",
        "semop",
        "semctl",
        "semtimedop",
        "msgget",
        "msgsnd",
        "msgrcv",
        "msgctl",
        "mq_open",
        "mq_unlink",
        "mq_timedsend",
        "mq_timedreceive",
        "mq_notify",
        "mq_getsetattr",
    }
    assert ipc <= set(_DENY)
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | EPERM, 0x00050000 | 38
    for nr in range(1024):
        expected = eperm if nr in denied or nr in (numbers["socket"], numbers["socketpair"]) else allow
        if nr == numbers["clone3"]:
            expected = enosys
        assert _run_bpf(prog, nr, arch) == expected, (machine, nr)  # arg0 0: socket(AF_UNSPEC) refused
    assert _run_bpf(prog, numbers["socket"], arch, 1) == allow  # AF_UNIX
    assert _run_bpf(prog, numbers["clone"], arch, 0x10000000) == eperm  # CLONE_NEWUSER
    assert _run_bpf(prog, numbers["clone"], arch, 0x11) == allow  # SIGCHLD, a plain fork
    assert _run_bpf(prog, 1, arch ^ 1) == 0x80000000  # another ABI: killed

"""Host side of the zygote: one pre-started sandbox interpreter per host process, which forks a sandbox per call.

A fresh interpreter per call (`percall.py`) pays for the interpreter's start, the mounts of the sealed
root and the seccomp program every time. The zygote (`zygote_server.py`, started lazily by the first
call under `unshare --net --pid --fork --mount --ipc --kill-child`) does that work once and forks one sandbox
per call, which still gets its own PID, mount and network namespace and its own private file systems.

The host talks to it over a SOCK_SEQPACKET socketpair only this process holds (a sandbox closes every
descriptor but its own before anything of the call runs). Per call the host sends a header (the limits, the
timeout, the working directory's name) and four descriptors: a fresh socketpair's end on which the answer
comes, memfds for stdout and stderr, and a memfd with the program. The zygote SIGKILLs the call's
PID-namespace init at the deadline (the kernel then kills the whole namespace), reaps it and only then
answers, once: `done`, the init's wait status, whether it was killed, and the call's status lines (`ready`
with the layers applied, `exit` with the program's status). So no process of the call is left when
`run_in_zygote` returns, and the caller's thread wakes once per call.

Many threads may call at once: the send is serialised, the waits are not. A zygote that died (killed, or its
host channel broken) is restarted on the next call; a call in flight when it died raises SandboxError, as
does one it fails to answer within the deadline plus `_KILL_GRACE_S` (it is then killed). A forked host
process gets its own zygote: the fork's copy of the parent's channel is closed at once
(`os.register_at_fork`) and the process id is checked on every call. When the zygote cannot start,
`ZygoteUnavailable` is raised (and remembered: `sandbox.run_python` then uses the per-call path, with a
RuntimeWarning). There is one zygote per root plan: calls with another allow-list of packages get their own.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from components.sandbox.proc import Call, Outcome, SandboxError, read_output

_SERVER = "".join(
    Path(__file__).with_name(name).read_text() + "\n" for name in ("seal.py", "child.py", "exit.py", "zygote_server.py")
)
# The zygote's command line: it reads its source from the channel it is started with (a long `-c` would stay in
# memory several times over, and every page of it is mapped again at every fork), compiled without docstrings.
_STUB = (
    "import _socket, sys\n_s = _socket.socket(fileno=int(sys.argv[1]))\n"
    "exec(compile(_s.recv(1 << 20), '<sao-zygote>', 'exec', optimize=2))\n_s.detach()\ndel _s\n_zygote_main()\n"
)
_START_TIMEOUT_S = 30.0
#: How long after the deadline the zygote may take to answer (it kills and reaps the call in milliseconds).
_KILL_GRACE_S = 5.0
_RIGHTS = (socket.SOL_SOCKET, socket.SCM_RIGHTS)


class ZygoteUnavailable(RuntimeError):
    """The zygote could not be started on this host (the caller falls back to one interpreter per call)."""


def _recv(sock: socket.socket, timeout_s: float) -> tuple[str | None, list[int]]:
    """One message (its trailing newline removed) and the descriptors it carried; ("", []) at EOF, (None, [])
    at the timeout."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(max(0, math.ceil(timeout_s * 1000))):
        return None, []
    msg, anc, _, _ = sock.recvmsg(8192, socket.CMSG_SPACE(4 * 4))
    fds = [
        f
        for level, kind, data in anc
        if (level, kind) == _RIGHTS
        for f in struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4])
    ]
    return msg.decode("utf-8", "replace").rstrip("\n"), fds


class _Zygote:
    """One running zygote: its `unshare` process, the control channel, its pid as this process sees it."""

    def __init__(
        self,
        key: tuple,
        unshare: str,
        python: str,
        plan: tuple[str, str],
        sys_path: tuple[str, ...],
        uid: int,
        gid: int,
        env: dict[str, str],
        host_dir: str | None,
    ) -> None:
        self.key = key
        self.ctl, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # `unshare` keeps a copy
        self.stderr = os.memfd_create("sao-zygote-stderr", os.MFD_CLOEXEC)
        top = tempfile.mkdtemp(prefix="sao-zygote-", dir=host_dir)  # the root's mount point while it is built
        argv = [
            unshare,
            "--net",
            "--pid",
            "--fork",
            "--mount",
            "--ipc",
            "--kill-child",
            "--",
            python,
            "-I",
            "-S",
            "-B",
            "-X",
            "utf8",
            "-c",
            _STUB,
            str(theirs.fileno()),
            top,
            str(uid),
            str(gid),
        ]
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self.stderr,
                env=dict(env),
                cwd="/",
                start_new_session=True,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            for s in (zygote_end, boot, theirs):
                s.close()
            self._close()
            raise ZygoteUnavailable(f"cannot start {unshare!r}: {exc}") from exc
        theirs.close()
        try:
            with boot, zygote_end:
                boot.send(_SERVER.encode())
                message = _plan_message(*plan, sys_path)
                boot.sendmsg([message], [_RIGHTS + (struct.pack("i", zygote_end.fileno()),)])
            ready, _ = _recv(self.ctl, _START_TIMEOUT_S)
            if ready is None or not ready.startswith("ready "):
                raise ZygoteUnavailable(f"the zygote did not start: {self.stderr_text() or 'no answer'}")
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                self.pid = int(f.read().split()[0])  # unshare's only child
        except BaseException:
            self.stop()
            self._close()
            raise
        finally:
            os.rmdir(top)  # the zygote's root no longer hangs there: pivot_root detached it

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_text(self) -> str:
        return os.pread(self.stderr, 4096, 0).decode("utf-8", "replace").strip() if self.stderr >= 0 else ""

    def stop(self) -> None:
        """Kill it (SIGKILL to `unshare`, whose --kill-child takes the zygote and all its sandboxes along)."""
        self.ctl.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _close(self) -> None:
        """The copies a forked host process inherited: close them, never touch the parent's zygote."""
        self.ctl.close()
        if self.stderr >= 0:
            os.close(self.stderr)
            self.stderr = -1


def _plan_message(plan_json: str, plan_report: str, sys_path: tuple[str, ...]) -> bytes:
    plan = json.loads(plan_json)
    fields = [w for path in plan["binds"] for w in ("bind", path)]
    fields += [w for path in plan["masks"] for w in ("mask", path)]
    fields += [w for path, target in plan["links"] for w in ("link", path, target)]
    fields += [w for path, target in plan["packages"] for w in ("package", path, target)]
    fields += [w for path in sys_path for w in ("path", path)]
    return "\0".join(fields + [plan_report]).encode("utf-8", "surrogateescape")


# Zygotes of this process by (unshare, interpreter, plan, sys.path, uid, gid); why a key could not start one.
_lock = threading.Lock()
_owner = os.getpid()
_zygotes: dict[tuple, _Zygote] = {}
_unavailable: dict[tuple, str] = {}
_inherited: list[_Zygote] = []  # a fork's copies of its parent's zygotes: kept, never waited for


def _forget_parents_zygotes() -> None:
    global _lock, _owner
    _lock = threading.Lock()
    _owner = os.getpid()
    for zygote in _zygotes.values():
        zygote._close()
        _inherited.append(zygote)
    _zygotes.clear()
    _unavailable.clear()


os.register_at_fork(after_in_child=_forget_parents_zygotes)


@atexit.register
def _stop_all() -> None:
    if _owner == os.getpid():
        for zygote in list(_zygotes.values()):
            zygote.stop()
        _zygotes.clear()


def zygote_pids() -> list[int]:
    """Host pids of the zygotes this process runs (for tests and the benchmark)."""
    if _owner != os.getpid():
        return []
    with _lock:
        return [z.pid for z in _zygotes.values() if z.alive()]


def zygote_cpu_seconds() -> float:
    """CPU time (user + system) of this process's zygotes and of every sandbox they reaped, from getrusage
    inside each zygote (microsecond resolution, unlike /proc/<pid>/stat)."""
    total = 0.0
    with _lock:
        zygotes = list(_zygotes.values())
    for zygote in zygotes:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with mine, theirs:
            with _lock:
                zygote.ctl.sendmsg([b"cpu"], [_RIGHTS + (struct.pack("i", theirs.fileno()),)])
            theirs.close()
            answer, _ = _recv(mine, 5.0)
        if answer is None or not answer.startswith("cpu "):
            raise SandboxError(f"the sandbox zygote {zygote.pid} did not report its CPU time")
        total += float(answer[4:])
    return total


def _retire(zygote: _Zygote) -> None:
    """Stop `zygote` and forget it (the next call starts a fresh one); the caller holds `_lock`."""
    if _zygotes.get(zygote.key) is zygote:
        del _zygotes[zygote.key]
    zygote.stop()


def _submit(key: tuple, start: dict, header: str, fds: list[int]) -> _Zygote:
    """Send one call's request to the zygote of `key`, starting or restarting it as needed."""
    if _owner != os.getpid():  # forked without the at-fork hook (a raw clone): never use the parent's channel
        _forget_parents_zygotes()
    with _lock:
        for _ in range(2):
            zygote = _zygotes.get(key)
            if zygote is not None and not zygote.alive():
                _retire(zygote)
                zygote = None
            if zygote is None:
                if key in _unavailable:
                    raise ZygoteUnavailable(_unavailable[key])
                try:
                    zygote = _Zygote(key, **start)
                except (ZygoteUnavailable, OSError, ValueError) as exc:
                    _unavailable[key] = str(exc)
                    raise ZygoteUnavailable(str(exc)) from exc
                _zygotes[key] = zygote
            try:
                zygote.ctl.sendmsg([header.encode()], [_RIGHTS + (struct.pack(f"{len(fds)}i", *fds),)])
                return zygote
            except OSError:  # EPIPE / ECONNRESET: it died since the last call
                _retire(zygote)
    raise SandboxError("the sandbox zygote cannot be reached after a restart")


def run_in_zygote(code: str, timeout_s: float, call: Call, unshare: str) -> Outcome:
    """Run `code` in a fork of this process's zygote (started on first use); the arguments as `run_percall`'s.

    The zygote enforces the deadline (it holds the call's PID 1) and answers once, after the call is reaped;
    waiting here for longer than the deadline plus `_KILL_GRACE_S` means the zygote hangs: it is killed, and
    with it the call. Raises ZygoteUnavailable when no zygote can be started, SandboxError when the zygote
    fails a call (it died, hangs, or could not fork).
    """
    python, plan, uid, gid, limits = call.python, call.plan, call.uid, call.gid, call.limits
    tmpfs_bytes, env, host_dir = call.tmpfs_bytes, call.env, call.host_dir
    max_output_bytes, max_file_bytes = call.max_output_bytes, call.max_file_bytes
    start = time.monotonic()
    key = (unshare, python, plan, call.sys_path, uid, gid)
    how = dict(
        unshare=unshare, python=python, plan=plan, sys_path=call.sys_path, uid=uid, gid=gid, env=env, host_dir=host_dir
    )
    work = f"/dev/shm/sao-sandbox-{os.urandom(6).hex()}/work"
    timeout_ms = max(1, math.ceil(timeout_s * 1000))
    header = " ".join(["call", *(str(v) for v in (uid, gid, *limits, tmpfs_bytes, timeout_ms)), work])
    fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("sao-main.py", "sao-stdout", "sao-stderr")]
    try:
        program, out_fd, err_fd = fds
        data = memoryview(code.encode("utf-8", "surrogatepass"))
        while data:
            data = data[os.write(program, data) :]
        channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with channel, theirs:  # closing our end (even on KeyboardInterrupt) makes the zygote kill the call
            zygote = _submit(key, how, header, [theirs.fileno(), out_fd, err_fd, program])
            theirs.close()
            reply, extra = _recv(channel, timeout_s + _KILL_GRACE_S)
        for fd in extra:
            os.close(fd)
        if reply is None:
            with _lock:
                _retire(zygote)
            raise SandboxError(f"the sandbox zygote did not answer within {timeout_s + _KILL_GRACE_S:.1f} s")
        if not reply.startswith("done "):
            why = reply[len("error ") :] if reply.startswith("error ") else zygote.stderr_text() or "it was killed"
            raise SandboxError(f"the sandbox zygote failed the call: {why}")
        wall_s = time.monotonic() - start
        first, *lines = reply.split("\n")
        wait_status, killed = (int(v) for v in first.split()[1:3])
        status = dict(line.partition(" ")[::2] for line in lines if line)
        exit_status = int(status["exit"]) if status.get("exit", "").lstrip("-").isdigit() else None
        # The program's status when its supervisor reported one (125: its setup failed), else the supervisor's.
        returncode = exit_status if exit_status is not None else os.waitstatus_to_exitcode(wait_status)
        stdout_b, stderr_b, err_tail, truncated = read_output(out_fd, err_fd, max_output_bytes, max_file_bytes)
        return Outcome(
            status.get("ready"), exit_status, returncode, bool(killed), stdout_b, stderr_b, err_tail, truncated, wall_s
        )
    finally:
        for fd in fds:
            os.close(fd)

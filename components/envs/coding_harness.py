"""The grading program of the coding environment: hidden tests in one process, the solution in another.

One sandbox call runs `harness_program(...)`. Its first process, the runner, holds the tests and the result
marker; before anything of the solution runs it deletes its own source file (`main.py`, the only copy of the
tests inside the sandbox), makes itself non-dumpable (so a process of the same user can neither read its
memory nor its descriptors through `/proc`, and the seccomp filter refuses ptrace and process_vm_*), and
starts the worker: a fresh interpreter (`-I -S -c`, so nothing of the runner's memory is copied) whose
stdout and stderr are /dev/null. The runner sends the solution over a pipe; the worker execs it and then
answers calls of the entry point. The tests run in the runner against a proxy of the entry point that sends
the arguments to the worker and receives the return value.

Values cross the pipe in a tagged JSON (`_enc` / `_dec`): None, bool, int, float, str, bytes, bytearray,
complex, and lists, tuples, dicts, sets and frozensets of them, each of exactly that type. So a solution can
return only plain data: an object whose `__eq__` always holds cannot cross, and no code of the solution ever
runs in the runner. An exception in the solution is raised again in the runner with the same type name and
message (a builtin `Exception` type itself, any other name as a new `Exception` subclass of that name), so
`test_errors` read as before. A `SystemExit` or `os._exit` in the solution ends only the worker; the runner
alone writes the one marked result line on its own stdout, which the worker cannot reach.

Timing matches the single-process harness: the load and each test get `limit_s`; the worker enforces it with
an alarm inside the solution, and a worker that does not answer within `limit_s` + `_GRACE_S` (it swallowed
the alarm) is killed, and that test and every later one count as `timeout`.

Honest solutions get the same grade as before. What changes: a test can only call the entry point (not other
names of the solution), arguments are copies (a test cannot observe the solution mutating them) and a return
value outside the types above fails the test (`TypeError: cannot send ...`). When the sandbox is degraded
(no namespaces: starting programs is refused) the worker is a fork of the runner, which does hold the tests:
grading is then not adversarially sound, as the sandbox itself is not.
"""

from __future__ import annotations

import json

RESULT_MARKER = "@@SAO-RESULT-{nonce}@@"
_GRACE_S = 0.5

# Shared by runner and worker: framing (4-byte length, then JSON) and the value codec.
_CODEC = r"""
import json as _json, os as _os, signal as _signal, sys as _sys

_MAX_MESSAGE = 1 << 20
_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "z"}


def _enc(x, depth=0):
    t = type(x)
    if depth > 100:
        raise ValueError("value nested too deeply")
    if x is None or t in (bool, int, float, str):
        return x
    if t in _TAGS:
        return {_TAGS[t]: [_enc(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[_enc(k, depth + 1), _enc(v, depth + 1)] for k, v in x.items()]}
    if t in (bytes, bytearray):
        return {"b" if t is bytes else "y": x.hex()}
    if t is complex:
        return {"c": [x.real, x.imag]}
    raise TypeError("cannot send a %s to the tests (plain data only)" % t.__name__)


def _dec(x):
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is not dict or len(x) != 1:
        raise ValueError("malformed value")
    (tag, v), = x.items()
    if tag == "l":
        return [_dec(e) for e in v]
    if tag in ("t", "s", "z"):
        return {"t": tuple, "s": set, "z": frozenset}[tag](_dec(e) for e in v)
    if tag == "d":
        return {_dec(k): _dec(e) for k, e in v}
    if tag in ("b", "y"):
        return (bytes if tag == "b" else bytearray).fromhex(v)
    if tag == "c":
        return complex(float(v[0]), float(v[1]))
    raise ValueError("unknown tag %r" % (tag,))


def _send(fd, message):
    data = _json.dumps(message).encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[_os.write(fd, data):]


def _read_exactly(fd, n):
    data = b""
    while len(data) < n:
        chunk = _os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the other process closed the channel")
        data += chunk
    return data


def _recv(fd):
    n = int.from_bytes(_read_exactly(fd, 4), "big")
    if n > _MAX_MESSAGE:
        raise ValueError("message of %d bytes is too large" % n)
    return _json.loads(_read_exactly(fd, n))
"""

_WORKER = r"""
class _Timeout(BaseException):
    pass


def _worker(rfd, wfd):
    def alarm(signum, frame):
        raise _Timeout()

    _signal.signal(_signal.SIGALRM, alarm)
    namespace = {"__name__": "__solution__"}
    entry = None

    def attempt(limit, action):
        try:
            try:
                _signal.setitimer(_signal.ITIMER_REAL, limit)
                return {"ok": _enc(action())}
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            return {"exc": ["timeout", ""]}
        except BaseException as exc:  # SystemExit too: it is the solution's error, not the worker's end
            return {"exc": [type(exc).__name__, str(exc)[:160]]}

    while True:
        message = _recv(rfd)
        if "load" in message:
            def load():
                exec(compile(message["load"], "<solution>", "exec"), namespace)
                if not callable(namespace.get(message["entry"])):
                    raise NameError("entry point %r is not defined" % message["entry"])
            reply = attempt(message["limit"], load)
            entry = namespace.get(message["entry"])
        else:
            args, kwargs = _dec(message["args"]), _dec(message["kwargs"])
            reply = attempt(message["limit"], lambda: entry(*args, **kwargs))
        reply["seq"] = message["seq"]
        try:
            _send(wfd, reply)
        except (TypeError, ValueError) as exc:
            _send(wfd, {"seq": message["seq"], "exc": [type(exc).__name__, str(exc)[:160]]})
"""

_WORKER_MAIN = "\n_worker(int(_sys.argv[1]), int(_sys.argv[2]))\n"

_RUNNER = r"""
import builtins as _builtins, select as _select, time as _time


def _start_worker(cfg, out):
    to_w, from_r = _os.pipe()
    to_r, from_w = _os.pipe()
    try:
        import subprocess
        proc = subprocess.Popen([_sys.executable, "-I", "-S", "-B", "-c", cfg["worker"], str(to_w), str(from_w)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, pass_fds=(to_w, from_w))
        pid = proc.pid
    except (PermissionError, OSError):  # degraded sandbox: no programs may be started
        pid = _os.fork()
        if pid == 0:
            null = _os.open(_os.devnull, _os.O_RDWR)
            for fd in (0, 1, 2):
                _os.dup2(null, fd)
            _os.close(out)
            try:
                _worker(to_w, from_w)
            finally:
                _os._exit(0)
    _os.close(to_w)
    _os.close(from_w)
    return pid, from_r, to_r


def _main(cfg, write=_os.write, dumps=_json.dumps):
    try:
        _os.unlink(__file__)  # the only copy of the tests the worker could otherwise read
    except OSError:
        pass
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: our /proc files are root's
    except Exception:
        pass
    out = _os.dup(1)
    null = _os.open(_os.devnull, _os.O_WRONLY)
    _os.dup2(null, 1)
    _os.dup2(null, 2)
    _sys.stdout = _sys.stderr = open(_os.devnull, "w")
    pid, send_fd, recv_fd = _start_worker(cfg, out)
    state = {"seq": 0, "dead": False}

    def request(message, limit):
        if state["dead"]:
            raise _Timeout()
        state["seq"] += 1
        message.update(seq=state["seq"], limit=limit)
        deadline = _time.monotonic() + limit + cfg["grace_s"]
        try:
            _send(send_fd, message)
            while True:
                left = deadline - _time.monotonic()
                if left <= 0 or not _select.select([recv_fd], [], [], left)[0]:
                    raise _Timeout()
                reply = _recv(recv_fd)
                if reply.get("seq") == state["seq"]:
                    break
        except (_Timeout, EOFError, OSError, ValueError) as exc:
            state["dead"] = True
            try:
                _os.kill(pid, 9)
            except OSError:
                pass
            if isinstance(exc, _Timeout):
                raise
            raise RuntimeError("the solution's process ended (%s)" % type(exc).__name__)
        if "exc" in reply:
            name, text = str(reply["exc"][0]), str(reply["exc"][1])
            if name == "timeout":
                raise _Timeout()
            cls = getattr(_builtins, name, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = type(name if name.isidentifier() else "SolutionError", (Exception,), {})
            raise cls(text)
        return _dec(reply["ok"])

    def proxy(*args, **kwargs):
        left = _signal.setitimer(_signal.ITIMER_REAL, 0)[0]  # the worker keeps the test's clock
        if left <= 0:
            raise _Timeout()
        start = _time.monotonic()
        try:
            return request({"args": _enc(args), "kwargs": _enc(kwargs)}, left)
        finally:
            _signal.setitimer(_signal.ITIMER_REAL, max(1e-3, left - (_time.monotonic() - start)))

    def alarm(signum, frame):
        raise _Timeout()

    _signal.signal(_signal.SIGALRM, alarm)

    def attempt(action, *args):
        try:
            try:
                _signal.setitimer(_signal.ITIMER_REAL, cfg["limit_s"])
                action(*args)
                return None
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            return "timeout"
        except BaseException as exc:
            return (type(exc).__name__ + ": " + str(exc))[:160]

    def load():
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        request({"load": cfg["solution"], "entry": cfg["entry_point"]}, cfg["limit_s"])

    tests = cfg["tests"]
    error = attempt(load)
    results = [error] * len(tests)
    if error is None:
        def run_test(source, name):
            exec(compile(source, name, "exec"), {"__name__": "__tests__", cfg["entry_point"]: proxy})
        results = [attempt(run_test, t, "<test %d>" % i) for i, t in enumerate(tests)]
    passed = sum(r is None for r in results)
    write(out, (cfg["marker"] + dumps({"passed": passed, "total": len(tests), "errors": results}) + "\n").encode())
    try:
        _os.kill(pid, 9)
    except OSError:
        pass
    _os._exit(0)


_main(_json.loads(_CONFIG))
"""


def harness_program(solution: str, entry_point: str, tests: list[str], limit_s: float, nonce: str) -> str:
    """The sandbox program that grades `solution` against `tests` and prints one marked result line."""
    config = {
        "solution": solution,
        "entry_point": entry_point,
        "tests": tests,
        "limit_s": limit_s,
        "grace_s": _GRACE_S,
        "marker": RESULT_MARKER.format(nonce=nonce),
        "worker": _CODEC + _WORKER + _WORKER_MAIN,
    }
    return f"_CONFIG = {json.dumps(config)!r}\n{_CODEC}{_WORKER}{_RUNNER}"

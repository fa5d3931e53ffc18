"""Child side of the sandbox, part 2: privileges, supervision and the program's process.

Its text follows `seal.py` and is run by the sandbox's interpreter (so nothing the sandboxed user can
write is ever executed with privileges); standard library only and self-contained, because it is never
imported. Two callers: `_sandbox_main` (this file: one fresh interpreter per call, `percall.py`) and
`zygote_server.py` (forks of the pre-started zygote).

Per call: the supervisor (the PID namespace's init, or without namespaces a subreaper that keeps the caller's
privileges) forks the program's process, reaps orphans, reports the program's exit status and kills whatever
is left; the program's process writes `main.py`, sets the rlimits, installs the seccomp filter and the audit
hook, reports `ready ...` on the status channel, closes it and runs the code. A fork of the zygote then ends
through `exit.exit_like_interpreter` instead of the interpreter's full teardown.
"""

import os
import sys


def _fail(msg):
    try:
        os.write(2, ("sandbox setup error: %s\n" % (msg,)).encode("utf-8", "replace"))
    finally:
        os._exit(125)


def _status_writer(status_fd):
    def status(line):
        os.write(status_fd, (line + "\n").encode("utf-8", "replace"))

    return status


def _load_libc(report):
    """`(libc, ctypes)` with the argument types the sandbox needs, or `(None, None)` (reported)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        libc.syscall.restype = ctypes.c_long
        return libc, ctypes
    except BaseException:
        report.append("ctypes-unavailable")
        return None, None


def _drop_privileges(libc, uid, gid, report):
    """no_new_privs, then setgroups -> setresgid -> setresuid to `uid`/`gid` (root only), verified."""
    if libc is not None and libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
        report.append("no_new_privs")
    if os.geteuid() != 0:
        report.append("user=%d(caller,no-drop)" % os.geteuid())
        return
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as e:
        _fail("cannot drop privileges: %r" % (e,))
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        _fail("privilege drop incomplete")
    try:
        os.setuid(0)
    except OSError:
        pass
    else:
        _fail("privilege drop is reversible")
    report.append("user=%d:%d" % (uid, gid))


def _kill_tree(child):
    """Without namespaces: kill the program's group and every child left, and reap them all."""
    me = os.getpid()
    while True:
        if child:
            try:
                os.killpg(child, 9)
            except OSError:
                pass
        try:
            with open("/proc/%d/task/%d/children" % (me, me)) as f:
                kids = f.read().split()
        except OSError:
            kids = []
        for k in kids:
            try:
                os.kill(int(k), 9)
            except OSError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            pass


def _supervise(child, ns, libc, status):
    """The supervisor's loop: reap until the program ends, kill what is left, report its status; never returns."""
    import _signal

    if not ns:
        try:
            os.setpgid(child, child)
        except OSError:
            pass
        status("child %d" % child)  # the caller kills that group if this supervisor does not answer
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    if libc is not None:
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: not ptrace-able by the program
    code = 255
    while True:
        try:
            p, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if p == child:
            if os.WIFSIGNALED(st):
                code = -os.WTERMSIG(st)
            elif os.WIFEXITED(st):
                code = os.WEXITSTATUS(st)
            break
    _signal.signal(_signal.SIGUSR1, _signal.SIG_IGN)
    if not ns:
        _kill_tree(child)  # with namespaces, the init's exit makes the kernel kill everything
    status("exit %d" % code)
    os._exit(0)


def _set_limits(mem, cpu, fsize, nproc, nofile):
    import resource as R

    def setlim(res, soft, hard):
        cur_soft, cur_hard = R.getrlimit(res)
        if cur_hard != R.RLIM_INFINITY:
            hard = min(hard, cur_hard)
        R.setrlimit(res, (min(soft, hard), hard))

    try:
        setlim(R.RLIMIT_CORE, 0, 0)
        setlim(R.RLIMIT_CPU, cpu, cpu + 1)
        setlim(R.RLIMIT_AS, mem, mem)
        setlim(R.RLIMIT_FSIZE, fsize, fsize)
        setlim(R.RLIMIT_NOFILE, nofile, nofile)
        setlim(R.RLIMIT_NPROC, nproc, nproc)
    except (OSError, ValueError) as e:
        _fail("cannot set resource limits: %r" % (e,))


def _run_program(
    src, work, limits, ns, lib, status, status_fd, caller_pid, report, seccomp=None, hook=None, finish=None
):
    """The program's process: main.py, rlimits, seccomp, audit hook, `ready`, then the code; never returns.

    The program ends as an interpreter ends (`finish` None: its SystemExit propagates to the top level), or
    through `finish(status)`, where status is the program's SystemExit or an exit status.

    `lib` is the list `[libc, ctypes]`; it is emptied, so that without namespaces no reference to them is left
    for the program to find.
    """
    libc, ctypes = lib
    del lib[:]
    path = os.path.join(work, "main.py")
    try:
        with open(path, "wb") as f:
            f.write(src)
    except OSError:
        pass
    _set_limits(*limits)
    report.append("rlimits")
    try:
        report.append(install_seccomp(libc, ctypes, seccomp))
    except (OSError, KeyError, AttributeError, TypeError) as e:
        report.append("NO-SECCOMP(%s)" % (e,))
    if hook is None:
        hook = _audit_hook(not ns, caller_pid)
    if not ns:
        _strip_for_degraded()
        libc = ctypes = None
        import gc

        gc.collect()  # drop the supervisor's ctypes objects from this process
    elif libc is not None:
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1 (was reset by setuid): normal /proc/self
    libc = ctypes = None
    sys.addaudithook(hook)
    report.append("audit_hook(net" + (")" if ns else ",exec,ctypes,kill)"))
    status("ready " + ",".join(report))
    os.close(status_fd)
    import builtins

    _install_exit_builtins()
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, work)
    try:
        code = compile(src, path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit as e:
        if finish is None:
            raise
        exit_status = e
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # hide this frame
        exit_status = 1
    else:
        exit_status = 0
    (finish or sys.exit)(exit_status)


def _install_exit_builtins():
    """`exit()` and `quit()` (`site` is not imported: -S)."""
    import builtins

    if getattr(builtins, "exit", None) is not None:
        return

    class Quitter:
        def __init__(self, name):
            self.name = name

        def __repr__(self):
            return "Use %s() to exit" % self.name

        def __call__(self, code=None):
            raise SystemExit(code)

    builtins.exit = Quitter("exit")
    builtins.quit = Quitter("quit")


def _sandbox_main():
    """One fresh interpreter per call (`percall.py`): `argv` carries the call's parameters."""
    a = sys.argv[1:]
    ns = a[0] == "ns"
    src_path, work, status_fd = a[1], a[2], int(a[3])
    uid, gid, mem, cpu, fsize, nproc, nofile, tmpfs_bytes, caller_pid = [int(x) for x in a[4:13]]
    report = []
    status = _status_writer(status_fd)
    try:
        with open(src_path, "rb") as f:
            src = f.read()
    except BaseException as e:
        _fail("cannot read program: %r" % (e,))
    if not hasattr(sys, "addaudithook"):
        _fail("interpreter too old (Python >= 3.8 needed)")
    libc, ctypes = _load_libc(report)
    if ns:  # we are root in a new mount namespace: the sealed root (seal.py)
        if libc is None:
            _fail("cannot seal the file system without ctypes")
        try:
            import json

            report.extend(
                seal_root(libc, ctypes, json.loads(a[13]), os.path.dirname(src_path), work, uid, gid, tmpfs_bytes)
            )
            report.append(a[14])
        except (OSError, ValueError, KeyError) as e:
            _fail("cannot seal the file system: %r" % (e,))
    try:
        os.chdir(work)
    except OSError as e:
        _fail("cannot enter working directory: %r" % (e,))
    if ns:
        _drop_privileges(libc, uid, gid, report)  # PID 1 of the namespace does not need privileges either
    elif libc is not None and libc.prctl(36, 1, 0, 0, 0) == 0:  # PR_SET_CHILD_SUBREAPER
        report.append("subreaper")

    import _signal

    child = 0

    def on_deadline(signum, frame):
        # Sent by the caller at the deadline (installed before the fork, so the program can never outlive its
        # supervisor).
        _kill_tree(child)
        status("exit killed")
        os._exit(0)

    if not ns:
        _signal.signal(_signal.SIGUSR1, on_deadline)
    try:
        child = os.fork()
    except OSError as e:
        _fail("cannot fork the program process: %r" % (e,))
    if child:
        _supervise(child, ns, libc, status)
    _signal.signal(_signal.SIGUSR1, _signal.SIG_DFL)
    if not ns:
        try:
            os.setpgid(0, 0)  # own group: the supervisor can kill it as a whole
        except OSError:
            pass
        _drop_privileges(libc, uid, gid, report)
    sys.path.extend(p for p in a[15].split(os.pathsep) if p)  # the allowed packages, after the standard library
    lib = [libc, ctypes]
    del libc, ctypes
    _run_program(src, work, (mem, cpu, fsize, nproc, nofile), ns, lib, status, status_fd, caller_pid, report)

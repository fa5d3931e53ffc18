"""Child side of the sandbox: runs inside the sandboxed process, before the untrusted code.

`sandbox.run_python` passes this file's text to the interpreter with `-c` (so nothing the sandboxed user can
write is ever executed with privileges). It sets up mounts, drops privileges, applies resource limits,
installs the audit hook, supervises the program and reports its status. Standard library only; it must stay
self-contained because it is never imported.
"""

import os, sys


def _sandbox_main():
    a = sys.argv[1:]
    ns = a[0] == "ns"
    src_path, work, status_fd = a[1], a[2], int(a[3])
    uid, gid, mem, cpu, fsize, nproc, nofile, tmpfs_bytes, caller_pid = [int(x) for x in a[4:13]]
    report = []

    def fail(msg):
        try:
            os.write(2, ("sandbox setup error: %s\n" % (msg,)).encode("utf-8", "replace"))
        finally:
            os._exit(125)

    def status(line):
        os.write(status_fd, (line + "\n").encode("utf-8", "replace"))

    try:
        import resource
        with open(src_path, "rb") as f:
            src = f.read()
    except BaseException as e:
        fail("cannot read program: %r" % (e,))
    if not hasattr(sys, "addaudithook"):
        fail("interpreter too old (Python >= 3.8 needed)")
    root = os.geteuid() == 0
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl = libc.prctl
    except BaseException:
        libc = prctl = ctypes = None
        report.append("ctypes-unavailable")

    # ---- namespaces: the sealed root (we are root in a new mount namespace; sandbox_seal.py) ----
    if ns:
        if libc is None:
            fail("cannot seal the file system without ctypes")
        try:
            import json
            libc.syscall.restype = ctypes.c_long
            report.extend(seal_root(libc, ctypes, json.loads(a[13]), os.path.dirname(src_path), work,
                                    uid, gid, tmpfs_bytes))
            report.append(a[14])
        except (OSError, ValueError, KeyError) as e:
            fail("cannot seal the file system: %r" % (e,))
    try:
        os.chdir(work)
    except OSError as e:
        fail("cannot enter working directory: %r" % (e,))

    def drop_privileges():
        if prctl is not None and prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
            report.append("no_new_privs")
        if not root:
            report.append("user=%d(caller,no-drop)" % os.geteuid())
            return
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            fail("cannot drop privileges: %r" % (e,))
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            fail("privilege drop incomplete")
        try:
            os.setuid(0)
        except OSError:
            pass
        else:
            fail("privilege drop is reversible")
        report.append("user=%d:%d" % (uid, gid))

    if ns:
        # PID 1 of the namespace does not need privileges either.
        drop_privileges()
    elif prctl is not None and prctl(36, 1, 0, 0, 0) == 0:  # PR_SET_CHILD_SUBREAPER
        report.append("subreaper")

    import _signal
    child = 0

    def kill_tree():
        if ns:
            return  # exiting as the namespace's init kills everything
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

    def on_deadline(signum, frame):
        # Sent by the caller at the deadline (installed before the fork, so
        # the program can never outlive its supervisor).
        kill_tree()
        status("exit killed")
        os._exit(0)

    if not ns:
        _signal.signal(_signal.SIGUSR1, on_deadline)
    try:
        child = os.fork()
    except OSError as e:
        fail("cannot fork the program process: %r" % (e,))

    if child:
        # ---- supervisor: the PID namespace's init (ns) or a subreaper that
        # stays with the caller's privileges (no ns).  It reaps orphans,
        # reports the program's exit status and kills whatever is left.
        if not ns:
            try:
                os.setpgid(child, child)
            except OSError:
                pass
        status("child %d" % child)
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        if prctl is not None:
            prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: not ptrace-able by the program
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
        kill_tree()
        status("exit %d" % code)
        os._exit(0)

    # ---- the program's process ----
    _signal.signal(_signal.SIGUSR1, _signal.SIG_DFL)
    if not ns:
        try:
            os.setpgid(0, 0)  # own group: the supervisor can kill it as a whole
        except OSError:
            pass
        drop_privileges()
    path = os.path.join(work, "main.py")
    try:
        with open(path, "wb") as f:
            f.write(src)
    except OSError:
        pass
    R = resource
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
        fail("cannot set resource limits: %r" % (e,))
    report.append("rlimits")
    try:
        report.append(install_seccomp(libc, ctypes))
    except (OSError, KeyError, AttributeError, TypeError) as e:
        report.append("NO-SECCOMP(%s)" % (e,))

    strict = not ns
    net_events = frozenset(("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                            "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                            "socket.getnameinfo"))
    strict_events = frozenset(("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                               "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
                               "ctypes.call_function", "ctypes.PyObj_FromPtr", "ctypes.string_at"))
    own_pgrp = os.getpgrp()
    supervisor = os.getppid()
    getpgid = os.getpgid
    def hook(event, args):
        if event == "socket.__new__":
            if args[1] != 1:  # only AF_UNIX (socketpair, e.g. for asyncio)
                raise PermissionError("sandbox: network access is disabled")
        elif event in net_events:
            raise PermissionError("sandbox: network access is disabled (%s)" % event)
        elif strict:
            if event in strict_events:
                raise PermissionError("sandbox: %s is disabled (degraded sandbox)" % event)
            if event == "os.kill":
                pid = args[0]
                if pid == 0 or pid == -own_pgrp:
                    return
                try:
                    ok = pid > 0 and pid not in (caller_pid, supervisor) and getpgid(pid) == own_pgrp
                except OSError:
                    ok = False
                if not ok:
                    raise PermissionError("sandbox: may only signal its own processes")
            elif event == "os.killpg":
                if args[0] not in (0, own_pgrp):
                    raise PermissionError("sandbox: may only signal its own process group")
    if strict:
        # Without namespaces: no way out of the killable process group, no
        # foreign code loading, no spawning of programs without the hook.
        import posix
        for mod in (os, posix):
            for name in ("setsid", "setpgid", "setpgrp", "pidfd_open"):
                try:
                    delattr(mod, name)
                except AttributeError:
                    pass
        try:
            import _signal
            del _signal.pidfd_send_signal
        except (ImportError, AttributeError):
            pass
        for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
            del sys.modules[name]
        for name in ("ctypes", "_ctypes"):
            sys.modules[name] = None
        def fork_exec(*args, **kwargs):
            raise PermissionError("sandbox: starting programs is disabled (degraded sandbox)")
        stub = type(sys)("_posixsubprocess")
        stub.fork_exec = fork_exec
        sys.modules["_posixsubprocess"] = stub  # its fork_exec would bypass the audit hook
        libc = prctl = ctypes = None
        import gc
        gc.collect()  # drop the supervisor's ctypes objects from this process
    elif prctl is not None:
        prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1 (was reset by setuid): normal /proc/self
    libc = prctl = ctypes = None
    sys.addaudithook(hook)
    report.append("audit_hook(net" + (",exec,ctypes,kill)" if strict else ")"))
    status("ready " + ",".join(report))
    os.close(status_fd)

    import builtins
    class Quitter:
        def __init__(self, name):
            self.name = name
        def __repr__(self):
            return "Use %s() to exit" % self.name
        def __call__(self, code=None):
            raise SystemExit(code)
    builtins.exit = Quitter("exit")
    builtins.quit = Quitter("quit")
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, work)
    try:
        code = compile(src, path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # hide this frame
        sys.exit(1)


if __name__ == "__main__":
    _sandbox_main()

"""Child side of the sandbox, part 4: the zygote, a pre-started interpreter that forks one sandbox per call.

Its source (this file after `seal.py`, `child.py` and `exit.py`) reaches the
interpreter over the channel it was started with (`zygote.py` starts it under `unshare --net --pid
--fork --mount --ipc --kill-child`, so the zygote is the init of its own PID namespace: when it dies, every
sandbox it forked dies with it); so does the control channel. Standard library only; never imported.

Once: read the root's plan, build the shared read-only part of the sealed root and `pivot_root` into it
(`build_root`, `pivot_into`), append the allowed packages' directory to `sys.path`, assemble the seccomp
program and the audit hook, import and run once what a call runs (`_warm_up`), `gc.freeze()` (forked children
do not copy pages for the collector), then answer `ready`.

Per request (a header and four descriptors: the call's status channel, stdout, stderr and a memfd holding the
program; the zygote never reads the program, so its memory holds nothing of any call that a later fork could
find): `unshare(CLONE_NEWPID)`, fork, `setns` back to its own PID namespace for the next call. The child is PID
1 of the new namespace (`_zygote_call`): it keeps only the call's descriptors, forks the program's process,
drops to nobody and supervises it like the per-call path. The program's process (PID 2, `_program_process`)
unshares its own mount and network namespace, mounts its private `/proc`, `/tmp`, `/var/tmp`, `/dev/shm` and
working directory, drops to nobody and runs `_run_program`. SysV IPC and message queues, scoped by the IPC
namespace that all calls share with the zygote, are refused by the seccomp filter. The zygote holds a pidfd
of PID 1, SIGKILLs it at the call's deadline (or when the caller hangs up), reaps it with `wait4` and only then
answers `done`: by then every process of the call's namespace is gone.
"""

import _socket
import gc
import select
import struct

_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWPID = 0x20000, 0x40000000, 0x20000000
_SCM_RIGHTS_LEVEL = (_socket.SOL_SOCKET, _socket.SCM_RIGHTS)


def _send(fd, text, fds=()):
    """One message on the SOCK_SEQPACKET channel `fd` (not taking ownership of it); False when the caller has
    gone (its call is then abandoned: its deadline no longer matters to anyone)."""
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, fd)  # no probing syscalls for the family
    try:
        anc = [_SCM_RIGHTS_LEVEL + (struct.pack("%di" % len(fds), *fds),)] if fds else []
        s.sendmsg([text.encode("utf-8", "replace")], anc)
        return True
    except OSError:
        return False
    finally:
        s.detach()


def _received_fds(anc):
    """The descriptors an SCM_RIGHTS message carried (`anc`, recvmsg's ancillary data)."""
    return [
        f
        for level, kind, data in anc
        if (level, kind) == _SCM_RIGHTS_LEVEL
        for f in struct.unpack("%di" % (len(data) // 4), data[: len(data) // 4 * 4])
    ]


def _cpu_seconds():
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _zygote_call(fds, null, uid, gid, libc):
    """PID 1 of a fresh PID namespace: fork the call's program process and supervise it; never returns.

    The init does as little as it can, because every page a fork of the zygote writes to is copied: it keeps
    only the call's descriptors, forks, drops to nobody and waits. The program's process sets up the rest.
    """
    # Descriptors: 0 /dev/null, 1 stdout, 2 stderr, 3 status pipe, 4 the program; nothing else (the
    # zygote's control channel and other calls' channels are closed here, before anything of this call runs).
    pipe, out, err, program = fds
    high = max(fds + [null]) + 1
    for i, fd in enumerate((null, out, err, pipe, program)):
        os.dup2(fd, high + i)  # first above every descriptor still needed, then into place
    for i in range(5):
        os.dup2(high + i, i)
    os.closerange(5, 1 << 20)
    if os.getpid() != 1:
        _fail("not the init of a new PID namespace")
    status = _status_writer(3)
    try:
        child = os.fork()
    except OSError as e:
        _fail("cannot fork the program process: %r" % (e,))
    if child:
        os.close(4)
        _drop_privileges(libc, uid, gid, [])
        _supervise(child, True, libc, status)
    return status


def _program_process(header, status, libc, ctypes, prepared):
    """PID 2: its own mount and network namespace and private file systems, then `_run_program`."""
    uid, gid, mem, cpu, fsize, nproc, nofile, tmpfs_bytes = [int(x) for x in header[:8]]
    work = header[-1]
    report = list(prepared["report"])
    try:
        src = os.pread(4, os.fstat(4).st_size, 0)
        os.close(4)
    except OSError as e:
        _fail("cannot read program: %r" % (e,))
    if libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET) != 0:
        _fail("unshare(mount, net): %s" % os.strerror(ctypes.get_errno()))
    try:
        report += private_mounts(libc, ctypes, "", work, uid, gid, tmpfs_bytes)
        os.chdir(work)
    except OSError as e:
        _fail("cannot mount the call's private file systems: %r" % (e,))
    os.environ["HOME"] = work
    _drop_privileges(libc, uid, gid, report)
    lib = [libc, ctypes]
    del libc, ctypes
    _run_program(
        src,
        work,
        (mem, cpu, fsize, nproc, nofile),
        True,
        lib,
        status,
        3,
        0,
        report,
        prepared["seccomp"],
        prepared["hook"],
        finish=exit_like_interpreter,
    )


def _serve(ctl, pidns, libc, ctypes, prepared):
    """The zygote's loop: a fork per request, a deadline and a reply per call; returns when the host is gone.

    A call ends when its PID 1 is reaped (every process of its namespace is gone then). Its reply is one
    message to the caller: `done <wait status of PID 1> <1 if killed at the deadline>`, then the lines the
    call wrote on its status pipe (`ready ...` before the program ran, `exit <status>` from PID 1). A call
    whose caller hung up (its thread was interrupted) is killed at once.
    """
    import _signal
    import time

    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    poller = select.poll()
    poller.register(ctl.fileno(), select.POLLIN)
    calls, channels = {}, {}  # pidfd -> [pid, channel, status pipe, deadline, killed]; channel -> pidfd

    def kill(pidfd):
        try:
            _signal.pidfd_send_signal(pidfd, 9)
        except OSError:
            pass  # already exited: its pidfd reports it and it is reaped as usual
        calls[pidfd][4] = True

    while True:
        now = time.monotonic()
        waiting = [c[3] for c in calls.values() if not c[4]]
        timeout = None if not waiting else max(0, int((min(waiting) - now) * 1000) + 1)
        events = poller.poll(timeout)
        for fd, _ in events:
            if fd in channels:  # POLLHUP: the caller is gone
                poller.unregister(fd)
                kill(channels.pop(fd))
            elif fd in calls:
                pid, channel, pipe, _, killed = calls.pop(fd)
                if channels.pop(channel, None) is not None:
                    poller.unregister(channel)
                poller.unregister(fd)
                wait_status = os.wait4(pid, 0)[1]
                lines = b""
                try:
                    while len(lines) < 65536:
                        chunk = os.read(pipe, 65536)
                        if not chunk:
                            break
                        lines += chunk
                except BlockingIOError:
                    pass
                _send(channel, "done %d %d\n" % (wait_status, killed) + lines.decode("utf-8", "replace"))
                for f in (channel, pipe, fd):
                    os.close(f)
        # After the batch: a new call may reuse the number of a descriptor closed above, which a later event
        # of this batch still names.
        if any(fd == ctl.fileno() for fd, _ in events):
            _accept(ctl, pidns, null, libc, ctypes, prepared, calls, channels, poller)
        now = time.monotonic()
        for pidfd, c in list(calls.items()):
            if not c[4] and now >= c[3]:
                kill(pidfd)


def _accept(ctl, pidns, null, libc, ctypes, prepared, calls, channels, poller):
    """Take one request from the control channel: fork a call (or answer `cpu`); exits at EOF."""
    import time

    msg, anc, flags, _ = ctl.recvmsg(4096, _socket.CMSG_SPACE(4 * 4))
    fds = _received_fds(anc)
    if not msg and not fds:
        os._exit(0)  # EOF: the host closed the channel or died; as PID 1 our exit kills every call
    words = msg.decode("utf-8", "replace").split(" ")
    if words[0] == "cpu" and len(fds) == 1:
        _send(fds[0], "cpu %.6f" % _cpu_seconds())
        os.close(fds[0])
        return
    if words[0] != "call" or len(fds) != 4 or len(words) != 11:
        for f in fds:
            os.close(f)
        return
    channel, out, err, program = fds
    deadline = time.monotonic() + int(words[9]) / 1000
    pipe, status = os.pipe()
    os.set_blocking(pipe, False)
    pid = -1
    if libc.unshare(_CLONE_NEWPID) != 0:
        _send(channel, "error unshare(pid): %s" % os.strerror(ctypes.get_errno()))
    else:
        try:
            pid = os.fork()
        except OSError as e:
            _send(channel, "error fork: %s" % e)
        if pid == 0:
            ctl.detach()
            status_writer = _zygote_call([status, out, err, program], null, int(words[1]), int(words[2]), libc)
            _program_process(words[1:], status_writer, libc, ctypes, prepared)
        if libc.setns(pidns, _CLONE_NEWPID) != 0:
            os._exit(1)  # the next call would not get a fresh PID namespace: stop, the host starts another
    for f in (status, out, err, program):
        os.close(f)
    if pid < 0:
        os.close(channel)
        os.close(pipe)
        return
    pidfd = os.pidfd_open(pid)
    calls[pidfd] = [pid, channel, pipe, deadline, False]
    channels[channel] = pidfd
    poller.register(pidfd, select.POLLIN)
    poller.register(channel, 0)


def _warm_up():
    """Run once, here, what every call runs (compile, exec, print, the exit path's flush), so that what those
    build lazily is built in the zygote instead of in every sandbox (its stdout is /dev/null)."""
    import builtins
    import io

    exec(compile("print([1], 'x', end='')\n", "<warm-up>", "exec", dont_inherit=True), {"__builtins__": builtins})
    _flush([sys.stdout, sys.stderr] + [o for o in gc.get_objects() if isinstance(o, io.IOBase)])


def _zygote_main():
    # The channel we were started with is also held by `unshare`, our parent; the control channel comes over
    # it, so that only this process holds the zygote's end: when we die, the host's next send fails at once.
    boot = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, int(sys.argv[1]))
    msg, anc, _, _ = boot.recvmsg(1 << 20, _socket.CMSG_SPACE(4))
    boot.close()
    ctl_fds = _received_fds(anc)
    if len(ctl_fds) != 1:
        _fail("no control channel in the plan's message")
    ctl = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, ctl_fds[0])
    top = sys.argv[2]
    uid, gid = int(sys.argv[3]), int(sys.argv[4])
    report = []
    libc, ctypes = _load_libc(report)
    if libc is None or not hasattr(os, "pidfd_open") or not hasattr(sys, "addaudithook"):
        _fail("the zygote needs ctypes and Python >= 3.9 (os.pidfd_open)")
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc.unshare.argtypes = [ctypes.c_int]
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    # The plan: NUL-separated records "bind" path | "mask" path | "path" path | "link" path target | "package"
    # path target, then the report word.
    fields = msg.decode("utf-8", "surrogateescape").split("\0")
    plan, i = {"binds": [], "masks": [], "paths": [], "links": [], "packages": []}, 0
    while fields[i] in ("bind", "mask", "path", "link", "package"):
        if fields[i] in ("link", "package"):
            plan[fields[i] + "s"].append((fields[i + 1], fields[i + 2]))
            i += 3
        else:
            plan[fields[i] + "s"].append(fields[i + 1])
            i += 2
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        report += build_root(libc, ctypes, plan, top, uid, gid, "/nonexistent")
        pivot_into(libc, ctypes, top)
    except (OSError, ValueError, KeyError) as e:
        _fail("cannot seal the file system: %r" % (e,))
    report.append(fields[i])
    sys.path.extend(plan["paths"])  # the allowed packages, after the standard library; every fork inherits it
    try:
        seccomp = prepare_seccomp(libc, ctypes)
    except KeyError:
        seccomp = None  # install_seccomp raises again per call and the call reports NO-SECCOMP(...)
    # What is the same for every call is made once: the filter, the audit hook, exit()/quit().
    prepared = {"seccomp": seccomp, "hook": _audit_hook(False, 0), "report": ["zygote"] + report}
    _install_exit_builtins()
    _warm_up()
    gc.collect()
    gc.freeze()
    libc.malloc_trim(0)  # give back free heap pages: fewer pages to map at every fork
    ctl.send(("ready zygote," + ",".join(report)).encode())
    _serve(ctl, pidns, libc, ctypes, prepared)
    os._exit(0)

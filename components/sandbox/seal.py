"""Child side of the sandbox, part 1: the sealed file-system view, the seccomp filter and the audit hook.

Its text comes first in what the interpreter runs (`-c` per call, or the zygote's source), so it is standard
library only and self-contained; it is also importable, so the tests can check the filter program without a
sandbox.

The sealed root, as root inside a new mount namespace, before the privilege drop: `build_root` builds a new
root on a small tmpfs holding only what the interpreter needs (the `plan` made by `rootfs.rootfs_plan`:
the interpreter, its standard library, the shared libraries they load, the allowed packages' entries under
their own directory), each a read-only, nosuid, nodev bind mount; a minimal `/dev` (null, zero, random,
urandom), a two-line `/etc/passwd` and the empty mount points of the private parts. `private_mounts` adds
what is each call's own: a fresh `/proc` of its PID namespace and size-limited tmpfs `/tmp`, `/var/tmp`,
`/dev/shm` and working directory. `pivot_into` then `pivot_root`s (runc's `pivot_root(".", ".")`), detaching
the host's root, so nothing of the host stays reachable, and makes the root read-only. The per-call path does
all three per call (`seal_root`); the zygote builds and pivots once and each of its calls mounts its private
parts in a copy of that mount namespace.

`install_seccomp` is the last thing the program process does before the untrusted code: a classic BPF filter
(prctl PR_SET_SECCOMP, SECCOMP_MODE_FILTER; it needs PR_SET_NO_NEW_PRIVS, set by the privilege drop) that
answers EPERM to the calls that create namespaces or reach other processes and kernels, and to SysV IPC and
POSIX message queues (table `_DENY`, searched as a binary tree), ENOSYS to clone3 (its flags live in memory a
BPF filter cannot read; glibc then falls back to clone, whose flags it can), EPERM to clone with any CLONE_NEW*
flag and to socket/socketpair of any family but AF_UNIX, and kills the process on any other ABI (i386 `int
0x80`, x32), which would otherwise bypass the table. `_audit_hook` is the in-interpreter third layer.
"""

import os
import struct

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
_RO = MS_RDONLY | MS_NOSUID | MS_NODEV

# Syscall numbers per architecture: (AUDIT_ARCH, numbers). x86_64 from asm/unistd_64.h, aarch64 from
# asm-generic/unistd.h (the aarch64 table is not exercised by the tests on this x86_64 host).
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        dict(
            ptrace=101,
            personality=135,
            chroot=161,
            mount=165,
            umount2=166,
            pivot_root=155,
            unshare=272,
            setns=308,
            keyctl=250,
            add_key=248,
            request_key=249,
            process_vm_readv=310,
            process_vm_writev=311,
            bpf=321,
            perf_event_open=298,
            userfaultfd=323,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            open_by_handle_at=304,
            name_to_handle_at=303,
            kexec_load=246,
            kexec_file_load=320,
            init_module=175,
            finit_module=313,
            delete_module=176,
            open_tree=428,
            move_mount=429,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            pidfd_getfd=438,
            acct=163,
            clone=56,
            clone3=435,
            socket=41,
            socketpair=53,
            shmget=29,
            shmat=30,
            shmctl=31,
            shmdt=67,
            semget=64,
            semop=65,
            semctl=66,
            semtimedop=220,
            msgget=68,
            msgsnd=69,
            msgrcv=70,
            msgctl=71,
            mq_open=240,
            mq_unlink=241,
            mq_timedsend=242,
            mq_timedreceive=243,
            mq_notify=244,
            mq_getsetattr=245,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            ptrace=117,
            personality=92,
            chroot=51,
            mount=40,
            umount2=39,
            pivot_root=41,
            unshare=97,
            setns=268,
            keyctl=219,
            add_key=217,
            request_key=218,
            process_vm_readv=270,
            process_vm_writev=271,
            bpf=280,
            perf_event_open=241,
            userfaultfd=282,
            io_uring_setup=425,
            io_uring_enter=426,
            io_uring_register=427,
            open_by_handle_at=265,
            name_to_handle_at=264,
            kexec_load=104,
            kexec_file_load=294,
            init_module=105,
            finit_module=273,
            delete_module=106,
            open_tree=428,
            move_mount=429,
            fsopen=430,
            fsconfig=431,
            fsmount=432,
            fspick=433,
            mount_setattr=442,
            pidfd_getfd=438,
            acct=89,
            clone=220,
            clone3=435,
            socket=198,
            socketpair=199,
            shmget=194,
            shmat=196,
            shmctl=195,
            shmdt=197,
            semget=190,
            semop=193,
            semctl=191,
            semtimedop=192,
            msgget=186,
            msgsnd=189,
            msgrcv=188,
            msgctl=187,
            mq_open=180,
            mq_unlink=181,
            mq_timedsend=182,
            mq_timedreceive=183,
            mq_notify=184,
            mq_getsetattr=185,
        ),
    ),
}
_DENY = (
    "ptrace",
    "chroot",
    "mount",
    "umount2",
    "pivot_root",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "process_vm_readv",
    "process_vm_writev",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "name_to_handle_at",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "pidfd_getfd",
    "acct",
    # SysV IPC and POSIX message queues: objects that outlive a call and are shared by every process of
    # an IPC namespace (the host's, for the per-call path), so a call could read or leave data there.
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
)
#: CLONE_NEWTIME | NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NEW_MASK = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_EPERM, _ENOSYS, _AF_UNIX = 1, 38, 1
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_LD_W_ABS, _JA, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06
_X32_SYSCALL_BIT = 0x40000000


def seccomp_program(machine):
    """The filter as a list of (code, jt, jf, k) for `machine` (os.uname().machine); KeyError if unknown."""
    arch, nr = _SYSCALLS[machine]
    allow, eperm = (_RET_K, 0, 0, _RET_ALLOW), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)
    # seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 * i (the low 32 bits first: little endian).
    prog = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, arch), (_RET_K, 0, 0, _RET_KILL_PROCESS), (_LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(_JGE_K, 0, 1, _X32_SYSCALL_BIT), (_RET_K, 0, 0, _RET_KILL_PROCESS)]
    # The denied numbers as a binary search tree (7 comparisons instead of a scan of the table: the kernel
    # runs the filter once per syscall number when it is installed, to cache the ones always allowed).
    tree = _search_tree(sorted({nr[name] for name in _DENY}))
    end = len(tree) + 1  # the EPERM after the tree: leaves jump there on a match, or to the one after
    for i, (code, jt, jf, k) in enumerate(tree):
        if code == _JEQ_K:
            jt, jf = end - i - 1, end - i
        prog.append((code, jt, jf, k))
    prog += [(_JA, 0, 0, 1), eperm]
    prog += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS)]
    prog += [(_JEQ_K, 0, 3, nr["clone"]), (_LD_W_ABS, 0, 0, 16), (_JSET_K, 0, 1, CLONE_NEW_MASK), eperm]
    prog += [
        (_LD_W_ABS, 0, 0, 0),
        (_JEQ_K, 1, 0, nr["socket"]),
        (_JEQ_K, 0, 3, nr["socketpair"]),
        (_LD_W_ABS, 0, 0, 16),
        (_JEQ_K, 1, 0, _AF_UNIX),
        eperm,
    ]
    prog += [
        (_LD_W_ABS, 0, 0, 0),
        (_JEQ_K, 0, 4, nr["personality"]),
        (_LD_W_ABS, 0, 0, 16),
        (_JEQ_K, 2, 0, 0),
        (_JEQ_K, 1, 0, 0xFFFFFFFF),
        eperm,
    ]
    prog.append(allow)
    return prog


def _search_tree(numbers):
    """Preorder binary search over sorted `numbers`: inner nodes `A >= k` (true: skip the left subtree),
    leaves `A == k` whose jumps `seccomp_program` fills in."""
    if len(numbers) == 1:
        return [(_JEQ_K, None, None, numbers[0])]
    mid = len(numbers) // 2
    left, right = _search_tree(numbers[:mid]), _search_tree(numbers[mid:])
    return [(_JGE_K, len(left), 0, numbers[mid])] + left + right


def prepare_seccomp(libc, ctypes):
    """`(fprog, keep-alive buffer, report word)` for this machine, ready for `install_seccomp`; KeyError when the
    architecture has no syscall table. Built once by the zygote, so a call only pays for the prctl."""
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise KeyError("no seccomp syscall table for architecture %r" % machine)
    prog = seccomp_program(machine)
    raw = b"".join(struct.pack("<HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    return SockFprog(len(prog), ctypes.addressof(buf)), buf, "seccomp(%s)" % machine


def install_seccomp(libc, ctypes, prepared=None):
    """Install `seccomp_program` for this machine; returns the report word or raises OSError/KeyError."""
    fprog, _buf, word = prepared or prepare_seccomp(libc, ctypes)
    # PR_SET_SECCOMP = 22, SECCOMP_MODE_FILTER = 2
    if libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return word


def _audit_hook(strict, caller_pid):
    """The audit hook: no non-UNIX sockets, no connect/bind/send/DNS; `strict` (no namespaces) also refuses
    spawning programs, ctypes and signals to processes outside the sandbox's process group."""
    net_events = frozenset(
        (
            "socket.connect",
            "socket.bind",
            "socket.sendto",
            "socket.sendmsg",
            "socket.getaddrinfo",
            "socket.gethostbyname",
            "socket.gethostbyaddr",
            "socket.getnameinfo",
        )
    )
    strict_events = frozenset(
        (
            "os.system",
            "os.exec",
            "os.posix_spawn",
            "os.spawn",
            "subprocess.Popen",
            "ctypes.dlopen",
            "ctypes.dlsym",
            "ctypes.dlsym/handle",
            "ctypes.call_function",
            "ctypes.PyObj_FromPtr",
            "ctypes.string_at",
        )
    )
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

    return hook


def _strip_for_degraded():
    """Without namespaces: no way out of the killable process group, no foreign code loading, no spawning of
    programs without the hook."""
    import posix
    import sys

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


def _mounter(libc, ctypes):
    def mount(src, dst, fstype, flags, opts=None):
        if libc.mount(src, dst.encode(), fstype, flags, opts.encode() if opts else None) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "mount %s on %s: %s" % (src, dst, os.strerror(e)))

    return mount


def _bind(mount, src, target, flags=_RO):
    """Bind `src` read-only (`flags`) on `target`, creating the mount point when it is missing."""
    if os.path.isdir(src):
        if not os.path.isdir(target):
            os.makedirs(target)
    elif not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o444))
    mount(src.encode(), target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_REMOUNT | MS_BIND | flags)


def build_root(libc, ctypes, plan, top, uid, gid, home):
    """The shared part of the sealed root on a tmpfs at `top`: the plan's read-only binds, links and masks,
    `/dev`, `/etc/passwd` (nobody's home is `home`) and the empty mount points of the private parts."""
    mount = _mounter(libc, ctypes)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    mount(b"tmpfs", top, b"tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, target in plan["links"]:
        os.makedirs(os.path.dirname(top + path), exist_ok=True)
        os.symlink(target, top + path)
    for path in plan["binds"]:
        _bind(mount, path, top + path)
    for path in plan["masks"]:  # site-packages inside the standard library: an empty read-only dir
        mount(b"tmpfs", top + path, b"tmpfs", _RO, "size=4k,mode=555")
    for path, target in plan["packages"]:  # the allowed packages, each entry at its place in PACKAGES_ROOT
        _bind(mount, path, top + target)
    os.makedirs(top + "/dev", exist_ok=True)
    for dev in ("null", "zero", "random", "urandom"):
        _bind(mount, "/dev/" + dev, top + "/dev/" + dev, MS_RDONLY | MS_NOSUID)  # a device node needs dev
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, top + "/dev/" + name)
    os.makedirs(top + "/etc", exist_ok=True)
    with open(top + "/etc/passwd", "w") as f:
        f.write("root:x:0:0:root:/nonexistent:/nonexistent\nnobody:x:%d:%d:nobody:%s:/nonexistent\n" % (uid, gid, home))
    with open(top + "/etc/group", "w") as f:
        f.write("root:x:0:\nnogroup:x:%d:\n" % gid)
    for d in ("/proc", "/tmp", "/var/tmp", "/dev/shm"):
        os.makedirs(top + d, exist_ok=True)
    return ["rootfs=minimal-ro"]


def private_mounts(libc, ctypes, top, work, uid, gid, tmpfs_bytes):
    """The private part of one call's root: a fresh `/proc` of the caller's PID namespace (`/proc/sys`
    read-only), size-limited tmpfs `/tmp`, `/var/tmp`, `/dev/shm` and working directory `work`."""
    mount = _mounter(libc, ctypes)
    mount(b"proc", top + "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _bind(mount, top + "/proc/sys", top + "/proc/sys")  # read-only (nobody cannot write it anyway)
    scratch = "size=%d,mode=1777" % tmpfs_bytes
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        mount(b"tmpfs", top + d, b"tmpfs", MS_NOSUID | MS_NODEV, scratch)
    os.makedirs(top + work, mode=0o755, exist_ok=True)
    mount(
        b"tmpfs", top + work, b"tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=700,uid=%d,gid=%d" % (tmpfs_bytes, uid, gid)
    )
    return ["tmpfs=/tmp+/var/tmp+/dev/shm+workdir"]


def pivot_into(libc, ctypes, top):
    """`pivot_root` into `top`, detach the host's root and make the new root read-only."""
    os.chdir(top)
    pivot_root = ctypes.c_long(_SYSCALLS[os.uname().machine][1]["pivot_root"])
    if libc.syscall(pivot_root, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    if libc.umount2(b".", MNT_DETACH) != 0:  # the host's root, now stacked on ours
        raise OSError(ctypes.get_errno(), "detaching the host root failed")
    os.chdir("/")
    _mounter(libc, ctypes)(None, "/", None, MS_REMOUNT | MS_BIND | _RO)


def seal_root(libc, ctypes, plan, top, work, uid, gid, tmpfs_bytes):
    """Build the minimal read-only root on a tmpfs at `top` and pivot into it (see the module docstring).

    Returns the report words; raises OSError naming the step that failed.
    """
    report = build_root(libc, ctypes, plan, top, uid, gid, work)
    report += private_mounts(libc, ctypes, top, work, uid, gid, tmpfs_bytes)
    pivot_into(libc, ctypes, top)
    return report

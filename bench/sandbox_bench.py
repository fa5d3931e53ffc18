"""Cost of one sandbox call: the zygote against one fresh interpreter per call, measured in one run.

Each path runs `print(1)` in rounds of calls, the two paths' rounds alternating (after a warm-up that plans
the root and starts the zygote), and reports the median wall time and the median CPU time of a call. The CPU
of a call is all CPU it costs in every process involved, each measured to the microsecond:

- zygote: the calling thread (`time.thread_time`) plus the zygote's own CPU and that of every sandbox it
  reaped (getrusage SELF + CHILDREN inside the zygote, `sandbox_zygote.zygote_cpu_seconds`, asked after each
  call; the zygote reaps a call before it answers, and answering that question is counted too);
- per call: the calling thread plus this process's reaped children (getrusage CHILDREN: `unshare`, the
  interpreter it starts and the program's process).

Not in those numbers: kernel threads' work on the call's behalf (freeing each call's network and mount
namespace happens in kernel workers). It is shown separately, as the CPU of all kernel threads of the host
during the rounds, per call: it includes whatever else the host does. The host's load average is printed
too: on a shared host other processes slow down every path, the wall time most.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

from components.sandbox import run as sandbox
from components.sandbox import zygote as sandbox_zygote
from components.sandbox.run import run_python

PROGRAM = "print(1)"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kernel_threads() -> dict[int, int]:
    """CPU clock ticks of every kernel thread (a child of kthreadd, pid 2) of the host, by pid."""
    ticks = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == "2":
            ticks[int(name)] = int(fields[11]) + int(fields[12])
    return ticks


def _kernel_seconds(before: dict[int, int], after: dict[int, int]) -> float:
    """Kernel-thread CPU between two snapshots (threads that ended in between are missed: a lower bound)."""
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / os.sysconf("SC_CLK_TCK")


def _calls(zygote: bool, calls: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each of `calls` calls of `PROGRAM`.

    A call's CPU is everything between the snapshot taken after the previous call and the one after it: the
    calling thread's CPU (the loop's own bookkeeping included) plus the zygote's and its reaped sandboxes', or
    this process's reaped children's.
    """
    other = sandbox_zygote.zygote_cpu_seconds if zygote else _children_cpu
    walls, cpus = [], []
    last = other() + time.thread_time()
    for _ in range(calls):
        start = time.perf_counter()
        result = run_python(PROGRAM)
        walls.append(time.perf_counter() - start)
        now = other() + time.thread_time()
        cpus.append(now - last)
        last = now
        if result.stdout != "1\n" or ("zygote" in result.isolation) != zygote:
            raise RuntimeError(f"unexpected result on the {'zygote' if zygote else 'per-call'} path: {result}")
    return walls, cpus


def _measure(rounds: int, calls: int) -> dict[bool, dict[str, float]]:
    """Medians per path (True: the zygote), the rounds of the two paths alternating so both see the same host."""
    samples: dict[bool, dict[str, list[float]]] = {z: {"wall": [], "cpu": [], "kernel": []} for z in (True, False)}
    for zygote in (True, False):
        sandbox.ZYGOTE = zygote
        _calls(zygote, 5)  # warm-up: plans the root, starts the zygote
    for _ in range(rounds):
        for zygote in (True, False):
            sandbox.ZYGOTE = zygote
            kernel_before = _kernel_threads()
            walls, cpus = _calls(zygote, calls)
            samples[zygote]["kernel"].append(_kernel_seconds(kernel_before, _kernel_threads()) / calls)
            samples[zygote]["wall"] += walls
            samples[zygote]["cpu"] += cpus
    return {
        z: {
            "wall": statistics.median(s["wall"]),
            "cpu": statistics.median(s["cpu"]),
            "kernel": statistics.mean(s["kernel"]),
        }
        for z, s in samples.items()
    }


def run(rounds: int = 3, calls: int = 50) -> dict[str, float]:
    if not sandbox._namespace_support()[0]:
        print("sandbox: namespaces unavailable here (not root, or no unshare): the zygote is not used")
        return {}
    saved = sandbox.ZYGOTE
    try:
        load_before = os.getloadavg()[0]
        measured = _measure(rounds, calls)
        load_after = os.getloadavg()[0]
    finally:
        sandbox.ZYGOTE = saved
    print(
        f"sandbox `{PROGRAM}`, {rounds} rounds x {calls} calls per path after a warm-up, medians per call "
        f"(host load average {load_before:.2f} before, {load_after:.2f} after)"
    )
    new, old = measured[True], measured[False]
    for name, m in (("zygote (fork per call)", new), ("per call (fresh interpreter)", old)):
        print(
            f"  {name:30s} wall {m['wall'] * 1e3:7.2f} ms   CPU {m['cpu'] * 1e3:7.2f} ms   "
            f"(+ host kernel threads {m['kernel'] * 1e3:5.2f} ms)"
        )
    wall_x, cpu_x = old["wall"] / new["wall"], old["cpu"] / new["cpu"]
    goal = new["wall"] <= 5e-3 and new["cpu"] <= 5e-3
    print(
        f"  per call / zygote: wall {wall_x:.1f}x, CPU {cpu_x:.1f}x "
        f"(goal <= 5 ms wall and CPU: {'met' if goal else 'NOT met'})"
    )
    return {
        "sandbox_zygote_wall_s": new["wall"],
        "sandbox_zygote_cpu_s": new["cpu"],
        "sandbox_percall_wall_s": old["wall"],
        "sandbox_percall_cpu_s": old["cpu"],
        "sandbox_wall_ratio": wall_x,
        "sandbox_cpu_ratio": cpu_x,
    }


if __name__ == "__main__":
    run()

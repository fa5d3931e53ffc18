"""The loop bench's step breakdown (bench/loop_bench.py) on hand-made rows: per-step deltas after the warm-up."""

import threading
import time

from bench.loop_bench import WARMUP, _thread_counters, breakdown


def _row(i: int) -> dict:
    """Step i: every cumulative counter grows by a fixed amount a step."""
    return {
        "n": 16,
        "tokens": 400,
        "trainer/wait_s": 0.01,
        "trainer/step_s": 0.2,
        "trainer/publish_s": 0.002,
        "counters": {
            "critic_s": 0.15 * i,
            "tool_calls": 28 * i,
            "tool_s": 0.56 * i,
            "trainer_s": 0.24 * i,
            "trainer_cpu_s": 0.18 * i,
            "trainer_queued_s": 0.035 * i,
        },
        "engine": {},
        "cpu": {"process": 0.35 * i, "machine": 0.4 * i},
    }


def test_breakdown_gives_per_step_parts_and_the_cpu_split():
    result = {"rows": [_row(i) for i in range(WARMUP + 10)], "step_s": 0.25}
    parts = dict(breakdown(result))
    assert abs(parts["trainer: critic, K updates"] - 0.15) < 1e-9
    assert abs(parts["trainer: policy update"] - 0.05) < 1e-9
    assert abs(parts["trainer: logging, checkpoints, other"] - (0.25 - 0.01 - 0.2 - 0.002)) < 1e-9
    lines = list(parts)
    cpu = next(line for line in lines if line.startswith("CPU per step"))
    assert "400 ms busy on the machine (1.60 of" in cpu and "350 ms in this process" in cpu and "50 ms elsewhere" in cpu
    thread = next(line for line in lines if line.startswith("trainer thread"))
    assert thread == (
        "trainer thread, in the learner step: 240 ms = 180 ms on a core + 35 ms waiting for one "
        "+ 25 ms for the GIL or I/O"
    )
    assert not any(line.startswith("engine thread") for line in lines)  # not counted, not shown
    tools = next(line for line in lines if line.startswith("tools:"))
    assert tools.startswith("tools: 28.0 env steps per step, 20.0 ms each") and abs(parts[tools] - 0.56) < 1e-9


def test_thread_counters_read_another_threads_schedstat():
    """A thread's time on a core and on its run queue (the first two fields of /proc/self/task/<tid>/schedstat, in
    seconds), read from another thread by its native id; they only grow, and a busy thread gains CPU time."""
    ids, done = [], threading.Event()

    def spin() -> None:
        ids.append(threading.get_native_id())
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    while not ids:
        time.sleep(0.001)
    time.sleep(0.1)
    first = _thread_counters("w", ids[0])
    with open(f"/proc/self/task/{ids[0]}/schedstat") as stat:
        on_cpu, queued = (int(x) / 1e9 for x in stat.read().split()[:2])
    done.set()
    worker.join()
    assert first["w_cpu_s"] >= 0.05 and first["w_cpu_s"] <= on_cpu and first["w_queued_s"] <= queued
    assert _thread_counters("w", None) == {}

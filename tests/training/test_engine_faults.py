"""The trainer on `rollout.backend = "http"` when engine servers die: real `sao engine serve` child processes,
SIGKILLed while they generate. One of two dying costs no step and no episode twice; all of them dying stops the
run with a clear error after `rollout.engine_wait_s`, and `--resume` finishes it once they are back."""

import contextlib
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from components.rollout.engine_process import EngineProcess
from components.tracking import DiskTracker, NullTracker
from tests.cli_args import sao, sets
from tests.conftest import child_env
from tests.training.test_trainer_loop import train_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def engines(sft_dir):
    """`engines(n)`: n started, healthy `sao engine serve` processes on the SFT policy; killed at teardown."""
    started: list[EngineProcess] = []

    def start(n: int) -> list[EngineProcess]:
        new = [
            EngineProcess(sft_dir, threads=1, env=child_env()).start(wait=False) for _ in range(n)
        ]  # they load in parallel
        started.extend(new)
        for engine in new:
            engine.wait_healthy()
        return new

    yield start
    for engine in started:
        engine.kill()


def _kill_while_generating(engine: EngineProcess, after: threading.Event, killed: dict) -> None:
    """Once `after` is set, SIGKILL `engine` as soon as it holds a request (or after 30 s in any case); records
    how many requests it held."""
    after.wait(timeout=300)
    deadline = time.monotonic() + 30
    in_flight = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            in_flight = engine.health()["in_flight"]
        if in_flight:
            break
        time.sleep(0.005)
    engine.kill()
    killed["in_flight"] = in_flight


def test_an_engine_killed_mid_run_costs_no_step_and_trains_no_episode_twice(tmp_path, tiny_cfg, sft_dir, engines):
    a, b = engines(2)
    cfg = replace(
        tiny_cfg,
        train=replace(
            tiny_cfg.train, backend="torch", batch_size=4, max_steps=4, checkpoint_every=0, collapse_guard="off"
        ),
        rollout=replace(
            tiny_cfg.rollout, concurrency=4, backend="http", urls=(a.url, b.url), request_retries=0, engine_wait_s=30.0
        ),
    )
    first_step, killed = threading.Event(), {}
    killer = threading.Thread(target=_kill_while_generating, args=(a, first_step, killed))
    killer.start()
    try:
        result = train_env(
            cfg,
            sft_dir,
            tmp_path,
            NullTracker(),
            log=lambda line: first_step.set() if line.startswith("step ") else None,
        )
    finally:
        first_step.set()
        killer.join()
    assert a.proc.returncode == -signal.SIGKILL and killed["in_flight"] >= 1, "a was not killed mid-generation"
    rows = result.history
    assert result.version == 4 and len(rows) == 4  # the run trained every step
    # Step 1's row was logged before the kill: both live, no error. After it, each request a held failed (once:
    # request_retries=0) and went to b, and a stayed down: at least as many errors as requests it held.
    assert (rows[0]["rollout/engine_errors"], rows[0]["rollout/engines_live"]) == (0.0, 2.0)
    assert rows[-1]["rollout/engine_errors"] >= killed["in_flight"] and rows[-1]["rollout/engines_live"] == 1.0
    # The failed requests were retried, not their episodes dropped; 4 steps x 4 trajectories, each a different
    # episode (task ids are unique along the task stream), so none was trained on twice.
    assert all(row["rollout/episodes_dropped"] == 0.0 for row in rows)
    assert len(result.trained_ids) == 16 and len(set(result.trained_ids)) == 16
    assert b.health()["version"] == 4  # the survivor got every published version


def _jsonl_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [r["step"] for r in DiskTracker.read(path) if "policy/loss" in r.get("metrics", {})]


@pytest.mark.reliability  # a whole process killed or resumed: make test-reliability (CI runs it)
def test_every_engine_killed_stops_the_run_then_resume_finishes_it(seeded_home, engines, prefect_env):
    """`sao train` exits 2 naming the servers and the wait; restarted on the same ports, `--resume` completes
    versions 1..N, none twice."""
    a, b = engines(2)
    home, wait_s = seeded_home, 3
    # max_staleness=0: no episode of step 2 starts before step 1 is trained, so step 2 needs the engines.
    args = [
        *sao("train", "--home", str(home), "--max-steps", "3"),
        *sets(
            {
                "train.backend": '"torch"',
                "train.batch_size": 4,
                "train.checkpoint_every": 1,
                "train.max_staleness": 0,
                "rollout.concurrency": 4,
                "task.eval_size": 4,
                "tracking.backend": '"disk"',
                "rollout.backend": '"http"',
                "rollout.urls": f'["{a.url}", "{b.url}"]',
                "rollout.engine_wait_s": wait_s,
            }
        ),
    ]
    jsonl = home / "runs" / "tiny-cpu" / "sao.jsonl"
    with open(home.parent / "first.err", "w+") as err:
        child = subprocess.Popen(args, cwd=REPO, env=prefect_env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while not _jsonl_steps(jsonl):
            assert child.poll() is None and time.monotonic() < deadline, "no first step"
            time.sleep(0.05)
        a.kill()
        b.kill()
        killed_at = time.monotonic()
        code = child.wait(timeout=120)
        stopped_s = time.monotonic() - killed_at
        err.seek(0)
        stderr = err.read()
    assert code == 2, stderr[-3000:]
    message = next((line for line in stderr.splitlines() if line.startswith("sao: ")), stderr[-3000:])
    assert message.startswith("sao: every engine server is down: waited "), message
    assert a.url in message and b.url in message and f"rollout.engine_wait_s = {wait_s} s" in message
    # Bounded: the wait, plus the requests' own failing and the process winding down.
    assert stopped_s < wait_s + 30
    assert _jsonl_steps(jsonl)[0] == 1 and len(_jsonl_steps(jsonl)) < 3

    a.start(wait=False), b.start(wait=False)
    a.wait_healthy(), b.wait_healthy()
    done = subprocess.run(args + ["--resume"], cwd=REPO, env=prefect_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _jsonl_steps(jsonl) == [1, 2, 3]  # the rewound log: each version once, none skipped
    assert a.health()["version"] == b.health()["version"] == 3

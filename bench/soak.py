"""`make soak` (`python -m bench.soak [--minutes 30]`): a long asynchronous SAO run with faults on a schedule.

The run is the production shape on one machine: two `sao engine serve` processes (rollout.backend="http"), the
artifact store in S3 (moto's server) behind a fault proxy, the trainer as its own `sao train` process. While it
runs, the schedule kills and restarts one engine, then fails the store in turns (5xx bursts, slow answers, the
endpoint down), every `--period` seconds. Every 5 s the resident memory of the trainer and the engines is
sampled. At the end the trainer is SIGKILLed (a crash, not a clean stop) and `sao train --resume` must continue
from its newest complete checkpoint to two more versions.

Verdicts (printed, and written with the samples and the plot under `--out`, default `.sao/soak/`):
    memory      the trainer's high-water RSS over the last third of the run at most `RSS_BAND` above its
                high-water over the second third (after warm-up). The trainer returns freed heap to the system
                after each checkpoint, so its RSS is a saw-tooth between checkpoints; a leak raises the peaks,
                while the troughs say nothing about growth. The slope over both thirds is reported too.
    throughput  trajectories/s of every `WINDOW_S` window after the first within `RATE_BAND` of their median
    nothing lost versions 1..N logged once each; every checkpoint the store calls complete verifies; the
                resumed run starts from the newest of them; engine errors were counted, not fatal
Exit status 1 when a verdict fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from components.rollout.engine_process import EngineProcess

REPO = Path(__file__).resolve().parent.parent
RSS_BAND = 0.10
"""Allowed growth of the trainer's peak resident memory from the second third of the run to the last (fraction)."""
RATE_BAND = 0.5
"""Allowed spread of windowed throughput around its median (fraction): faults cost time, never a stall."""
WINDOW_S = 300.0
"""Throughput window of a 30-minute soak; a shorter soak uses a sixth of its length (at least a minute)."""
SAMPLE_S = 5.0
BUCKET = "soak"
TRAIN = [
    "--set",
    'train.backend="torch"',
    "--set",
    "train.batch_size=16",
    "--set",
    "train.checkpoint_every=25",
    "--set",
    "rollout.concurrency=32",
    "--set",
    "task.eval_size=8",
    "--set",
    "train.max_steps=1000000",
    "--set",
    'rollout.backend="http"',
    "--set",
    "rollout.request_timeout_s=30",
    "--set",
    'train.collapse_guard="off"',
]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "components.cli", *args]


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` in MiB (VmRSS), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def analyse(samples: list[dict], steps: list[dict], batch: int, window_s: float = WINDOW_S) -> dict:
    """The verdicts from the RSS samples (`{"t", "trainer", "engines"}`) and the trainer's step records
    (`{"step", "time"}`, in order); throughput in windows of `window_s`, the first (warm-up) left out."""
    end = samples[-1]["t"]
    second = [s["trainer"] for s in samples if end / 3 <= s["t"] < 2 * end / 3 and s["trainer"]]
    last = [s["trainer"] for s in samples if s["t"] >= 2 * end / 3 and s["trainer"]]
    growth = max(last) / max(second) - 1
    settled = [(s["t"] / 60, s["trainer"]) for s in samples if s["t"] >= end / 3 and s["trainer"]]
    slope = statistics.linear_regression(*zip(*settled)).slope if len(settled) > 1 else 0.0
    t0 = steps[0]["time"]
    windows: dict[int, int] = {}
    for r in steps:
        w = int((r["time"] - t0) // window_s)
        windows[w] = windows.get(w, 0) + 1
    full = [windows.get(w, 0) * batch / window_s for w in range(1, int((steps[-1]["time"] - t0) // window_s))]
    rate = statistics.median(full) if full else 0.0
    spread = max((abs(x - rate) / rate for x in full), default=0.0) if rate else 1.0
    versions = [r["step"] for r in steps]
    return {
        "rss_median_mib": statistics.median(second + last),
        "rss_peak_mib": [max(second), max(last)],
        "rss_peak_growth": growth,
        "rss_slope_mib_per_min": slope,
        "memory_ok": growth <= RSS_BAND,
        "traj_per_s_median": rate,
        "traj_per_s_windows": full,
        "rate_spread": spread,
        "throughput_ok": bool(full) and spread <= RATE_BAND,
        "versions": len(versions),
        "versions_ok": versions == list(range(1, len(versions) + 1)),
    }


def plot(samples: list[dict], steps: list[dict], batch: int, out: Path, events: list[tuple[float, str]] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    minutes = [s["t"] / 60 for s in samples]
    ax1.plot(minutes, [s["trainer"] for s in samples], label="trainer")
    for i in range(max(len(s["engines"]) for s in samples)):
        ax1.plot(minutes, [s["engines"][i] for s in samples], label=f"engine {i}", alpha=0.7)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title("soak: resident memory and throughput (red: a scheduled fault)")
    ax1.legend(loc="lower right")
    t0 = samples[0]["wall"]
    per_min: dict[int, int] = {}
    for r in steps:
        per_min[int((r["time"] - t0) // 60)] = per_min.get(int((r["time"] - t0) // 60), 0) + batch
    ax2.bar(list(per_min), [v / 60 for v in per_min.values()], width=0.9, align="edge")
    for at, what in events:  # the scheduled faults, on both panels
        if what.startswith("fault:") and not what.endswith("back"):
            for ax in (ax1, ax2):
                ax.axvline(at / 60, color="red", alpha=0.3, linewidth=1)
    ax2.set_ylabel("trajectories/s (1-min bins)")
    ax2.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(out)


def _checkpoints(endpoint: str) -> list[int]:
    """Complete checkpoint steps in the soak's bucket (read from moto directly, past the proxy)."""
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="soak", aws_secret_access_key="soak", region_name="us-east-1"
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="sao/checkpoints/")
    return sorted(
        int(m.group(1))
        for page in pages
        for o in page.get("Contents", [])
        if (m := re.search(r"/step-(\d{8})/_COMPLETE$", o["Key"]))
    )


def _faults(k: int, engines: list[EngineProcess], proxy, say) -> None:
    """The k-th scheduled fault (they rotate): an engine killed and restarted, store 5xx and slow, store down."""
    kind = k % 3
    if kind == 0:
        engine = engines[(k // 3) % len(engines)]
        say(f"fault: engine {engine.url} SIGKILLed; restarted in 20 s")
        engine.kill()
        time.sleep(20)
        engine.start()
        say(f"fault: engine {engine.url} back")
    elif kind == 1:
        say("fault: store answers 503 to half the requests for 20 s, then 2 s late for 20 s")
        proxy.mode("5xx", fraction=0.5, duration_s=20)
        time.sleep(20)
        proxy.mode("slow", delay_s=2.0, duration_s=20)
        time.sleep(20)
    else:
        say("fault: store down for 30 s")
        proxy.mode("down", duration_s=30)
        time.sleep(30)
        proxy.mode("pass")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the faulted run (default 30)")
    parser.add_argument("--period", type=float, default=150.0, help="seconds between scheduled faults")
    parser.add_argument("--home", type=Path, default=REPO / ".sao", help="home holding (or given) the SFT policy")
    parser.add_argument("--out", type=Path, default=REPO / ".sao" / "soak", help="samples, plot, logs")
    args = parser.parse_args(argv)
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request

    from components.tracking import DiskTracker
    from tests.faultproxy import FaultProxy

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    events: list[tuple[float, str]] = []
    clock = {"start": time.monotonic()}  # restarted when the trainer starts: the soak is measured from there

    def say(line: str) -> None:
        at = time.monotonic() - clock["start"]
        events.append((at, line))
        print(f"[{at / 60:5.1f} min] {line}", flush=True)

    subprocess.run(_cli("sft", "--home", str(args.home)), check=True, cwd=REPO)
    sft = args.home / "models" / "sft-tir_math"
    home = out / "home"
    if home.exists():
        import shutil

        shutil.rmtree(home)
    (home / "models").mkdir(parents=True)
    subprocess.run(["cp", "-a", str(sft), str(home / "models")], check=True)
    with ExitStack() as stack:
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        stack.callback(moto.stop)
        endpoint = "http://%s:%d" % moto.get_host_and_port()
        import boto3

        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="soak", aws_secret_access_key="soak", region_name="us-east-1"
        ).create_bucket(Bucket=BUCKET)
        proxy = stack.enter_context(FaultProxy(endpoint))
        engines = [EngineProcess(sft, threads=1, log=out / f"engine-{i}.log") for i in range(2)]
        for engine in engines:
            engine.start()
            stack.callback(engine.kill)
        urls = json.dumps([e.url for e in engines])
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": proxy.url,
            "AWS_ACCESS_KEY_ID": "soak",
            "AWS_SECRET_ACCESS_KEY": "soak",
            "AWS_DEFAULT_REGION": "us-east-1",
            "SAO_STORE_URI": f"s3://{BUCKET}/sao",
        }
        train = _cli("train", "--home", str(home), *TRAIN, "--set", f"rollout.urls={urls}")
        log = (out / "trainer.log").open("w")
        trainer = subprocess.Popen(train, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        clock["start"] = start = time.monotonic()
        stack.callback(lambda: trainer.poll() is None and trainer.kill())
        say(f"soak: trainer pid {trainer.pid}, engines {[e.url for e in engines]}, store {proxy.url} -> {endpoint}")
        samples: list[dict] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                samples.append(
                    {
                        "t": time.monotonic() - start,
                        "wall": time.time(),
                        "trainer": rss_mib(trainer.pid),
                        "engines": [rss_mib(e.proc.pid) if e.proc else None for e in engines],
                    }
                )

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = start + args.minutes * 60
        k = 0
        while time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(min(args.period, max(0.0, deadline - time.monotonic())))
            if time.monotonic() < deadline - 60 and trainer.poll() is None:
                _faults(k, engines, proxy, say)
                k += 1
        crashed = trainer.poll()
        done.set()
        sampler.join()
        proxy.mode("pass")
        if crashed is not None:
            say(f"soak: FAILED, the trainer exited with status {crashed} during the run; see {out / 'trainer.log'}")
            return 1
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        jsonl = home / "runs" / "tiny-cpu" / "sao.jsonl"
        steps = [r for r in DiskTracker.read(jsonl) if "reward/mean" in r.get("metrics", {})]
        complete = _checkpoints(endpoint)
        say(
            f"soak: trainer SIGKILLed at version {steps[-1]['step']}; newest complete checkpoint {complete[-1]} "
            f"of {len(complete)}"
        )
        resume = subprocess.run(
            train + ["--resume", "--max-steps", str(complete[-1] + 2)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
        )
        (out / "resume.log").write_text(resume.stdout + resume.stderr)
        resumed = re.search(r"resumed from \S+/step-(\d{8})", resume.stdout + resume.stderr)  # Prefect logs to stderr
        after = [r["step"] for r in DiskTracker.read(jsonl) if "reward/mean" in r.get("metrics", {})]
    batch = 16
    verdict = analyse(samples, steps, batch, min(WINDOW_S, max(60.0, args.minutes * 10)))
    errors = max((r["metrics"].get("rollout/engine_errors", 0) for r in steps), default=0)
    verdict.update(
        {
            "minutes": args.minutes,
            "faults": [e for _, e in events if e.startswith("fault:")],
            "engine_errors": errors,
            "checkpoints_complete": len(complete),
            "resume_ok": resume.returncode == 0
            and resumed is not None
            and int(resumed.group(1)) == complete[-1]
            and after == list(range(1, complete[-1] + 3)),
            "proxy": proxy.stats(),
        }
    )
    plot(samples, steps, batch, out / "soak.png", events)
    (out / "rss.json").write_text(json.dumps(samples))
    (out / "summary.json").write_text(json.dumps(verdict, indent=2, default=str))
    ok = all(verdict[k] for k in ("memory_ok", "throughput_ok", "versions_ok", "resume_ok"))
    print(json.dumps({k: v for k, v in verdict.items() if k != "traj_per_s_windows"}, indent=2, default=str))
    print(f"soak: {'PASSED' if ok else 'FAILED'}; plot {out / 'soak.png'}, samples {out / 'rss.json'}")
    if not verdict["resume_ok"]:
        print(f"soak: the resume did not continue from checkpoint {complete[-1]}; see {out / 'resume.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

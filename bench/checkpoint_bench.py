"""Checkpoints off the loop (issue 44): how long the training loop stalls per checkpoint when the checkpoint is
published on the loop's thread, against the run's `Checkpointer` (components/training/rl/checkpoint.py), which
writes the checkpoint into local scratch on the loop's thread and hashes and publishes it on a thread of its own,
one in flight; and what hashing and moving the files several at once buys (`threads`).

`make bench BENCH=checkpoint`. A checkpoint is `--mb` megabytes in `--files` tensors (as a rank's model and
optimizer partitions are), saved every `--every-s` seconds of a loop whose steps sleep (on a GPU the step runs on
the device while the host is free). Two stores: a local directory on this disk, and S3 through moto's threaded
server (a real HTTP endpoint on loopback). For each store, `--saves` checkpoints an arm:

    inline      stage + publish on the loop's thread: the loop stalls for all of it
    background  `Checkpointer.save`: the loop stalls for the wait on the one before (none when it finished within
                the step) and the staging, while the upload runs beside the next steps
    threads=1   the background arm with files hashed and moved one at a time (the stores' default: min(8, cores))

How to read it: `stall` is the median loop stall per checkpoint; `publish` the median time from staged to complete
in the store; `inline / arm` divides the inline arm's stall by the arm's (above 1: the loop waits less).

Flags (or `BENCH_CHECKPOINT_*` under `make bench`): `--mb 256`, `--files 8`, `--saves 4`, `--every-s 3`. The table
and a JSON go to `$SAO_HOME/bench/` (default `.sao/bench/`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench import report
from components.storage.artifacts import STORE_THREADS, ArtifactStore, LocalStore
from components.training.rl.checkpoint import Checkpointer, CheckpointStore

BUCKET = "bench"


def payload(mb: int, files: int) -> dict[str, torch.Tensor]:
    """`files` float32 tensors of `mb` megabytes together (random: no file compresses or deduplicates)."""
    numel = mb * 10**6 // 4 // files
    generator = torch.Generator().manual_seed(0)
    return {f"part{i}": torch.rand(numel, generator=generator) for i in range(files)}


@contextmanager
def stores(root: Path, threads: int) -> Iterator[dict[str, Callable[[str], ArtifactStore]]]:
    """{store name: a function of a sub-prefix giving a fresh store} for the local directory and moto's S3."""
    from moto.server import ThreadedMotoServer

    from components.storage.s3 import S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench"
    )
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield {
            "local": lambda sub, t=threads: LocalStore(root / sub, threads=t),
            "s3 (moto)": lambda sub, t=threads: S3Store(BUCKET, sub, threads=t),
        }
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def inline_arm(store: TimedStore, tensors: dict, saves: int, every_s: float) -> tuple[list[float], list[float]]:
    """Loop stalls and publish times with the checkpoint published on the loop's thread."""
    stalls, publishes = [], []
    for step in range(1, saves + 1):
        time.sleep(every_s)  # the steps between two checkpoints
        began = time.perf_counter()
        scratch = store.stage(step, tensors)
        staged = time.perf_counter()
        store.publish(step, scratch)
        stalls.append(time.perf_counter() - began)
        publishes.append(time.perf_counter() - staged)
    return stalls, publishes


class TimedStore(CheckpointStore):
    """A checkpoint store that notes when each checkpoint's staging ended (for the background arm's publish time)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.staged_at: dict[int, float] = {}

    def stage(self, step: int, *args, **kwargs) -> Path:
        scratch = super().stage(step, *args, **kwargs)
        self.staged_at[step] = time.perf_counter()
        return scratch


def background_arm(store: TimedStore, tensors: dict, saves: int, every_s: float) -> tuple[list[float], list[float]]:
    """Loop stalls (in `Checkpointer.save`: the wait on the one before, the staging) and publish times."""
    publishes: list[float] = []
    done = lambda step, uri: publishes.append(time.perf_counter() - store.staged_at[step])  # noqa: E731
    checkpointer = Checkpointer(store, 0, done)
    stalls = []
    for step in range(1, saves + 1):
        time.sleep(every_s)
        began = time.perf_counter()
        checkpointer.save(step, tensors, final=step == saves)
        stalls.append(time.perf_counter() - began)
    checkpointer.wait()
    return stalls, publishes


ARMS = {
    "inline": (inline_arm, None),
    "background": (background_arm, None),
    "background, threads=1": (background_arm, 1),
}


def table(result: dict) -> str:
    lines = [
        "| store | arm | stall per checkpoint, median (min-max) | publish, median | inline / arm |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['store']} | {row['arm']} | {row['stall_s']:.2f} s ({min(row['stalls']):.2f}-"
            f"{max(row['stalls']):.2f}) | {row['publish_s']:.2f} s | {row['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def run(
    mb: int | None = None,
    files: int | None = None,
    saves: int | None = None,
    every_s: float | None = None,
    out: Path | None = None,
) -> dict:
    env = os.environ.get
    mb = mb or int(env("BENCH_CHECKPOINT_MB", "256"))
    files = files or int(env("BENCH_CHECKPOINT_FILES", "8"))
    saves = saves or int(env("BENCH_CHECKPOINT_SAVES", "4"))
    every_s = every_s if every_s is not None else float(env("BENCH_CHECKPOINT_EVERY_S", "3"))
    if mb < 1 or files < 1 or saves < 1 or every_s < 0:
        raise SystemExit("checkpoint: mb, files and saves at least 1, every_s at least 0")
    out = report.out_dir(out)
    tensors = payload(mb, files)
    header = report.Header()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sao-checkpoint-bench-") as tmp, stores(Path(tmp), STORE_THREADS) as made:
        for store_name, make in made.items():
            inline_stall = None
            for n, (arm, (measure, threads)) in enumerate(ARMS.items()):
                sub = f"{store_name.split()[0]}-{n}"
                store = TimedStore(make(sub, threads or STORE_THREADS), "checkpoints", Path(tmp) / "scratch")
                stalls, publishes = measure(store, tensors, saves, every_s)
                stall = statistics.median(stalls)
                inline_stall = inline_stall or stall
                rows.append(
                    {
                        "store": store_name,
                        "arm": arm,
                        "stalls": stalls,
                        "publishes": publishes,
                        "stall_s": stall,
                        "publish_s": statistics.median(publishes),
                        "ratio": inline_stall / stall,
                    }
                )
    result = {
        **header.fields(),
        "bytes": mb * 10**6,
        "files": files,
        "saves": saves,
        "every_s": every_s,
        "store_threads": STORE_THREADS,
        "rows": rows,
    }
    text = table(result)
    print(
        f"\n== checkpoints of {mb} MB in {files} files, {saves} an arm, one every {every_s:g} s of steps; load average "
        f"{header.load[0]:.2f} at the start, {result['load_average_at_end'][0]:.2f} at the end =="
    )
    print(text)
    report.write(out, "checkpoint", text, result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=None, help="a checkpoint's size in MB (default 256)")
    parser.add_argument("--files", type=int, default=None, help="files per checkpoint (default 8)")
    parser.add_argument("--saves", type=int, default=None, help="checkpoints an arm (default 4)")
    parser.add_argument("--every-s", type=float, default=None, help="seconds of steps between two (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="where the table and JSON go (default .sao/bench)")
    args = parser.parse_args(argv)
    run(args.mb, args.files, args.saves, args.every_s, args.out)


if __name__ == "__main__":
    main()

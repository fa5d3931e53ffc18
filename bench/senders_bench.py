"""One version's bytes to one server from 1, 2 and 4 senders over gloo (issue 44): does splitting the buckets among
the trainer's ranks move the same bytes faster than one rank sending them all?

`make bench BENCH=senders`. Each arm spawns its senders and one receiver (the server), processes of one torch thread
each. Every sender forms a gloo pair group with the receiver (components/rollout/pairs.py `pair_group`, the
collective transport's own), and the version, `--mb` megabytes in buckets of `--bucket-mb`, is split as
`rollout.transfer_senders = "all"` splits it (components/rollout/senders.py): sender s broadcasts buckets s, s + k,
s + 2k, ... over its pair with the transport's `send_buffers` (at most two posted and not completed), and the
receiver takes them with the server's `receive_buckets` (bucket i over pair i mod k, one bucket more than there are
senders posted ahead, each into a buffer of its own). A round is timed on the receiver from its start (the senders
start on its signal) to the last bucket's arrival; after a warm-up round, `--rounds` rounds an arm, the arms run twice in opposite
orders (1, 2, 4, 4, 2, 1) so drift on a shared machine hits them alike.

How to read it: GB/s is the version's bytes over the median round (GB = 1e9 bytes); `x 1 sender` divides the
one-sender arm's median by the arm's (above 1: faster). On one host every pair is loopback TCP through the same
kernel and cores: k senders are k streams and k + 1 processes on this machine's cores, not k NICs, so this measures
what splitting costs and gains in the transport's own code and the kernel's copies; across machines each sender
would bring its own link (`sao plan` does that arithmetic).

Flags (or `BENCH_SENDERS_*` under `make bench`): `--senders 1,2,4`, `--mb 400`, `--bucket-mb 32`, `--rounds 5`.
The table and a JSON of every sample go to `$SAO_HOME/bench/` (default `.sao/bench/`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from bench import report
from components.rollout.engine_process import free_port
from components.rollout.pairs import pair_group
from components.rollout.transfer import ALIGN, receive_buckets, send_buffers

TIMEOUT_S = 300.0


def buckets_of(total: int, bucket: int) -> list[int]:
    """Sizes of the buckets `total` bytes make, each `bucket` bytes but the last, each rounded up to the transport's
    alignment (a bucket holds whole aligned tensors)."""
    return [-(-min(bucket, total - start) // ALIGN) * ALIGN for start in range(0, total, bucket)]


def owned(count: int, senders: int, sender: int) -> list[int]:
    """The buckets (indices) `sender` of `senders` sends: round-robin."""
    return list(range(sender, count, senders))


def _role(rank: int, senders: int, port: int, sizes: list[int], rounds: int, results) -> None:
    """Process `rank`: senders 0 .. k-1, the receiver k (which hosts the store and reports the round times)."""
    torch.set_num_threads(1)
    receiver = rank == senders
    store = TCPStore("127.0.0.1", port, None, receiver, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if receiver:
        pairs = [pair_group(store, f"s{s}", 1, "gloo", "127.0.0.1", TIMEOUT_S) for s in range(senders)]
        buckets = [(size, [(f"bucket{i}", "uint8", (size,))]) for i, size in enumerate(sizes)]
        times = []
        for r in range(rounds + 1):  # the first warms every pair up
            began = time.perf_counter()
            store.set(f"go/{r}", "1")
            receive_buckets(pairs, buckets, lambda tensors: None, TIMEOUT_S)
            times.append(time.perf_counter() - began)
        results.put(times[1:])
        return
    group = pair_group(store, f"s{rank}", 0, "gloo", "127.0.0.1", TIMEOUT_S)
    mine = [torch.full((sizes[i],), i % 251, dtype=torch.uint8) for i in owned(len(sizes), senders, rank)]
    for r in range(rounds + 1):
        store.wait([f"go/{r}"])
        send_buffers(group, mine, TIMEOUT_S)


def time_arm(senders: int, sizes: list[int], rounds: int) -> list[float]:
    """Seconds of each measured round with `senders` senders."""
    results = mp.get_context("spawn").Queue()
    mp.spawn(_role, args=(senders, free_port(), sizes, rounds, results), nprocs=senders + 1, join=True)
    return results.get()


def table(result: dict) -> str:
    lines = [
        "| senders | buckets each | s/version, median | min-max | GB/s | x 1 sender |",
        "|---|---|---|---|---|---|",
    ]
    for arm in result["arms"]:
        lines.append(
            f"| {arm['senders']} | {arm['buckets_each']} | {arm['median_s']:.3f} | {arm['min_s']:.3f}-{arm['max_s']:.3f} "
            f"| {arm['gb_per_s']:.2f} | {arm['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def run(
    senders: tuple[int, ...] | None = None,
    mb: int | None = None,
    bucket_mb: int | None = None,
    rounds: int | None = None,
    out: Path | None = None,
) -> dict:
    env = os.environ.get
    senders = senders or tuple(int(s) for s in env("BENCH_SENDERS_SENDERS", "1,2,4").split(","))
    mb = mb or int(env("BENCH_SENDERS_MB", "400"))
    bucket_mb = bucket_mb or int(env("BENCH_SENDERS_BUCKET_MB", "32"))
    rounds = rounds or int(env("BENCH_SENDERS_ROUNDS", "5"))
    if 1 not in senders or min(senders) < 1 or mb < 1 or bucket_mb < 1 or rounds < 1:
        raise SystemExit("senders: positive counts including 1 (the baseline); mb, bucket_mb, rounds: at least 1")
    out = report.out_dir(out)
    sizes = buckets_of(mb * 10**6, bucket_mb * 10**6)
    header = report.Header()
    samples: dict[int, list[float]] = {k: [] for k in senders}
    for order in (senders, tuple(reversed(senders))):
        for k in order:
            samples[k] += time_arm(k, sizes, rounds)
    baseline = statistics.median(samples[1])
    arms = []
    for k in senders:
        median = statistics.median(samples[k])
        arms.append(
            {
                "senders": k,
                "buckets_each": f"{len(owned(len(sizes), k, k - 1))}-{len(owned(len(sizes), k, 0))}",
                "seconds": samples[k],
                "median_s": median,
                "min_s": min(samples[k]),
                "max_s": max(samples[k]),
                "gb_per_s": sum(sizes) / 1e9 / median,
                "speedup": baseline / median,
            }
        )
    result = {
        **header.fields(),
        "bytes": sum(sizes),
        "bucket_bytes": bucket_mb * 10**6,
        "rounds": rounds,
        "arms": arms,
    }
    text = table(result)
    print(
        f"\n== one version of {sum(sizes) / 1e6:.0f} MB in {len(sizes)} buckets to one receiver, from 1..k senders over "
        f"gloo pairs: {2 * rounds} rounds an arm; load average {header.load[0]:.2f} at the start, "
        f"{result['load_average_at_end'][0]:.2f} at the end =="
    )
    print(text)
    report.write(out, "senders", text, result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", default=None, help="comma-separated sender counts, 1 included (default 1,2,4)")
    parser.add_argument("--mb", type=int, default=None, help="the version's size in MB (default 400)")
    parser.add_argument("--bucket-mb", type=int, default=None, help="bucket size in MB (default 32)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds an arm and pass (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="where the table and JSON go (default .sao/bench)")
    args = parser.parse_args(argv)
    run(
        tuple(int(s) for s in args.senders.split(",")) if args.senders else None,
        args.mb,
        args.bucket_mb,
        args.rounds,
        args.out,
    )


if __name__ == "__main__":
    main()

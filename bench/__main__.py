"""`python -m bench [name ...]`: run the benchmarks (all by default)."""

import sys

import torch

from bench import (
    async_bench,
    checkpoint_bench,
    engine_bench,
    gae_bench,
    loop_bench,
    placement_bench,
    sandbox_bench,
    senders_bench,
    transfer_bench,
    updates_bench,
)

BENCHES = {
    "gae": gae_bench.run,
    "engine": engine_bench.run,
    "async": async_bench.run,
    "loop": loop_bench.run,
    "sandbox": sandbox_bench.run,
    "placement": placement_bench.run,
    "transfer": transfer_bench.run,
    "senders": senders_bench.run,
    "updates": updates_bench.run,
    "checkpoint": checkpoint_bench.run,
}


def main(argv: list[str]) -> None:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {list(BENCHES)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in names:
        BENCHES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])

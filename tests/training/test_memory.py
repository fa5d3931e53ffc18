"""`memory.trim`: the allocator's free memory goes back to the OS (the soak's memory verdict depends on it)."""

import threading

import pytest
import torch

from components.training.engines import memory


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_trim_returns_what_threads_freed():
    if not memory.trim():
        pytest.skip("no malloc_trim in this C library")
    kept = []

    def churn():  # freed tensors interleaved with kept ones: the free memory is trapped between them
        tensors = [torch.ones(256, 256 + i % 64) for i in range(800)]
        kept.extend(tensors[::100])

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    before = _rss_mib()
    assert memory.trim()
    after = _rss_mib()
    assert before - after > 100, f"RSS {before:.0f} MiB -> {after:.0f} MiB"
    assert all(float(t[0, 0]) == 1.0 for t in kept)  # what is in use stays

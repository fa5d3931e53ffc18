"""`make bench BENCH=senders` runs: every arm's senders and receiver in one run, the table and its JSON (its figures
are in docs/benchmarks.md). No timing is asserted: only the split of the buckets and the table's shape."""

import json

from bench import senders_bench


def test_the_buckets_are_split_round_robin_among_the_senders():
    assert senders_bench.buckets_of(100, 32) == [32, 32, 32, 16]  # the last 4 bytes rounded up to the alignment
    assert senders_bench.owned(13, 4, 1) == [1, 5, 9]
    assert sorted(i for s in range(4) for i in senders_bench.owned(13, 4, s)) == list(range(13))  # each bucket once


def test_the_senders_benchmark_times_each_count_against_one_sender(tmp_path, capsys):
    result = senders_bench.run(senders=(1, 2), mb=3, bucket_mb=1, rounds=1, out=tmp_path)
    out = capsys.readouterr().out
    assert result["bytes"] == 3_000_000 and [a["senders"] for a in result["arms"]] == [1, 2]
    one, two = result["arms"]
    assert len(one["seconds"]) == len(two["seconds"]) == 2  # one round in each of the two passes
    assert one["speedup"] == 1.0 and two["buckets_each"] == "1-2"
    assert two["speedup"] == one["median_s"] / two["median_s"]
    assert "| 2 | 1-2 |" in out and (tmp_path / "senders.md").read_text() in out
    assert json.loads((tmp_path / "senders.json").read_text())["arms"][1]["senders"] == 2

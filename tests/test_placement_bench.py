"""`make bench BENCH=placement` runs: two gloo ranks, both arms, a ratio (its figures are in docs/benchmarks.md)."""

import re

from bench import placement_bench


def test_the_placement_benchmark_times_both_arms_and_prints_their_ratio(monkeypatch, capsys):
    monkeypatch.setenv("BENCH_PLACEMENT_STEPS", "1")
    placement_bench.run()
    out = capsys.readouterr().out
    steps = [float(m) for m in re.findall(r"median step\s+([\d.]+) ms", out)]
    assert len(steps) == 2 and all(t > 0 for t in steps)
    ratio = float(re.search(r"overlapped / baseline: ([\d.]+)", out).group(1))
    assert abs(ratio - steps[1] / steps[0]) < 1e-3

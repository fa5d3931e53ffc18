"""`make bench BENCH=updates` runs: both arms on one engine, the table and its JSON (its figures are in
docs/benchmarks.md). No timing is asserted: only the lengths' draw and what each arm did."""

import json

from bench import updates_bench


def test_the_lengths_are_a_capped_pareto_tail_the_same_for_both_arms():
    lengths = updates_bench.pareto_lengths(10_000, 1.2, 8, 384)
    assert lengths == updates_bench.pareto_lengths(10_000, 1.2, 8, 384)
    assert min(lengths) == 8 and max(lengths) == 384
    assert sorted(lengths)[len(lengths) // 2] < sum(lengths) / len(lengths)  # a heavy tail: median below mean


def test_the_updates_benchmark_continues_in_one_arm_and_drains_in_the_other(tmp_path, capsys):
    result = updates_bench.run(seconds=1.0, period=0.3, slots=4, out=tmp_path)
    out = capsys.readouterr().out
    cont, drain = result["arms"]
    assert (cont["mode"], drain["mode"]) == ("continue", "drain") and len(cont["runs"]) == len(drain["runs"]) == 2
    assert cont["updates_applied"] >= 1 and cont["recomputed"] > 0  # in-flight caches recomputed on new weights
    assert drain["recomputed"] == 0  # nothing in flight when a drained update applies
    assert all(0 <= arm["slots_idle"] <= 1 for arm in result["arms"]) and cont["vs_continue"] == 1.0
    assert "| drain |" in out and json.loads((tmp_path / "updates.json").read_text())["arms"][1]["mode"] == "drain"

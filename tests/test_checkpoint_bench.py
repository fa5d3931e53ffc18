"""`make bench BENCH=checkpoint` runs: every arm against both stores, each checkpoint complete in its store, the table
and its JSON (its figures are in docs/benchmarks.md). No timing is asserted: only what each arm did."""

import json

from bench import checkpoint_bench


def test_the_checkpoint_benchmark_publishes_every_checkpoint_of_every_arm(tmp_path, capsys):
    result = checkpoint_bench.run(mb=2, files=2, saves=2, every_s=0.0, out=tmp_path)
    rows = result["rows"]
    assert [(r["store"], r["arm"]) for r in rows] == [
        (store, arm) for store in ("local", "s3 (moto)") for arm in ("inline", "background", "background, threads=1")
    ]
    assert all(len(r["stalls"]) == len(r["publishes"]) == 2 for r in rows)  # every checkpoint reached its store
    assert all(r["ratio"] == 1.0 for r in rows if r["arm"] == "inline")
    out = capsys.readouterr().out
    assert "| s3 (moto) | background |" in out
    assert json.loads((tmp_path / "checkpoint.json").read_text())["rows"][1]["arm"] == "background"


def test_the_payload_is_the_size_asked_in_the_files_asked():
    tensors = checkpoint_bench.payload(4, 3)
    assert len(tensors) == 3 and sum(t.numel() * 4 for t in tensors.values()) <= 4 * 10**6
    assert sum(t.numel() * 4 for t in tensors.values()) > 4 * 10**6 - 12

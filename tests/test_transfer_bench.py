"""`make bench BENCH=transfer` runs: two real servers, every arm in one run, the table and its JSON (its figures are
in docs/benchmarks.md). No timing is asserted: only the table's shape and the bytes each arm moved."""

import json

from bench import transfer_bench
from components.config import load_config
from components.models import build_policy, config_tokenizer
from components.rollout.transfer import plan_buckets


def test_the_transfer_benchmark_times_every_arm_against_the_filesystem_and_counts_their_bytes(tmp_path, capsys):
    result = transfer_bench.run(models=("tiny",), versions=1, warmup=0, buckets_mb=(512, 1), out=tmp_path)
    out = capsys.readouterr().out

    cfg = load_config("tiny-cpu").model
    policy = build_policy(cfg, config_tokenizer(cfg.tokenizer))
    assert not policy.config.tie_word_embeddings  # every tensor of the state dict is sent, each once
    weights = policy.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    expected = {
        "filesystem": 2 * model_bytes,  # each of the two servers reads the model once
        "collective, 512 MB buckets": 2 * sum(size for size, _ in plan_buckets(weights, 512 * 2**20)),
        "collective, 1 MB buckets": 2 * sum(size for size, _ in plan_buckets(weights, 2**20)),
    }
    assert len(plan_buckets(weights, 2**20)) > 1  # the small buckets really split the model

    (model,) = result["models"]
    assert model["model_bytes"] == model_bytes and model["params"] == 767_232
    assert [arm["arm"] for arm in model["arms"]] == list(expected)
    for arm in model["arms"]:
        assert arm["bytes"] == [expected[arm["arm"]]], arm["arm"]
        assert len(arm["seconds"]) == 1 and arm["seconds"][0] > 0 and arm["warmup_s"] == []
        assert arm["gb_per_s"] > 0 and arm["probe_max_abs_diff"] < 1e-4 and arm["collective_retries"] == 0
    assert model["arms"][0]["vs_filesystem"] == 1.0
    assert set(model["gloo_floor_s"]) == {"reused", "fresh"} and all(t > 0 for t in model["gloo_floor_s"].values())
    assert model["arms"][0]["written"][0] > model_bytes  # the HF directory: the weights, config and tokenizer
    assert all(arm["written"] == [0] for arm in model["arms"][1:])  # the collective writes nothing

    table = transfer_bench.table(result)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model | params | arm | s/version, median | min-max | bytes/version | GB/s |")
    assert [row.split(" | ")[2] for row in rows[1:]] == list(expected)
    assert all(len(row.split("|")) == 10 for row in rows)
    assert table in out
    assert (tmp_path / "transfer.md").read_text() == table + "\n"
    assert (
        json.loads((tmp_path / "transfer.json").read_text())["models"][0]["arms"][1]["bytes"]
        == model["arms"][1]["bytes"]
    )

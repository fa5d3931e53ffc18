"""`sao sweep`: N seeds from one SFT policy, a table, MLflow runs nested under one parent, re-runs continue."""

import csv
import json
from pathlib import Path

import pytest

from components.cli import main

SMALL = [
    "--set",
    "train.max_steps=2",
    "--set",
    "train.batch_size=4",
    "--set",
    "rollout.concurrency=4",
    "--set",
    "task.eval_size=8",
    "--set",
    'train.backend="torch"',
    "--set",
    "value_pretrain.episodes=16",
    "--set",
    "value_pretrain.max_epochs=1",
]


def test_sweep_writes_a_table_and_nested_mlflow_runs_and_continues(seeded_home, capsys):
    from mlflow.tracking import MlflowClient

    home = seeded_home
    assert main(["sweep", "--home", str(home), "--seeds", "2", "--name", "t", *SMALL]) == 0
    out = capsys.readouterr().out
    root = home / "sweeps" / "t"
    rows = list(csv.DictReader((root / "results.csv").open()))
    assert [r["seed"] for r in rows] == ["1", "2"]
    assert (root / "seed-1" / "checkpoints" / "tiny-cpu" / "step-00000002").is_dir()
    assert "sweep: 2 seed(s)" in (root / "results.md").read_text() and "sweep: 2 seed(s)" in out
    client = MlflowClient(f"sqlite:///{home.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sao").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("sao.sweep") == "t")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["t/seed-1", "t/seed-2"]
    assert all("eval/tir_math/accuracy" in r.data.metrics for r in children)
    assert parent.data.metrics["sweep/accuracy_min"] == min(float(r["accuracy"]) for r in rows)
    # Every seed starts from the one critic pretrained on the SFT policy, as the pipeline's RL does.
    critics = {
        json.loads((root / f"seed-{k}" / "batches" / "manifest.json").read_text())["config"]["train"]["critic_path"]
        for k in (1, 2)
    }
    assert len(critics) == 1 and (Path(critics.pop()) / "value_head.safetensors").is_file()

    # Re-running continues: finished seeds are read back (no new runs), the SFT evaluation is reused, one more
    # seed is added. A result file from before the run's early reward and staleness were measured gets them from
    # the run's metrics.
    done = root / "seed-1" / "result.json"
    full = json.loads(done.read_text())
    done.write_text(json.dumps({k: v for k, v in full.items() if k not in ("early_reward", "staleness_max")}))
    assert main(["sweep", "--home", str(home), "--seeds", "3", "--name", "t", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "seed 1 finished earlier" in out and "seed 2 finished earlier" in out and "eval: reusing" in out
    assert len(list(csv.DictReader((root / "results.csv").open()))) == 3
    assert json.loads(done.read_text()) == full and full["staleness_max"] >= 0 and full["evicted"] == 0

    # Another config under the same name is refused, naming what to do.
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--home", str(home), "--seeds", "1", "--name", "t", *SMALL, "--set", "train.policy_lr=1e-3"])
    assert exit_info.value.code == 2 and "holds a sweep of another config" in capsys.readouterr().err


def test_a_field_added_later_leaves_the_hash_of_a_config_at_its_default(tiny_cfg):
    from dataclasses import replace

    from components.stages.sweep import sweep_name, swept_config

    near = replace(tiny_cfg, train=replace(tiny_cfg.train, rollback_to="near-peak"))
    assert "rollback_to" not in swept_config(tiny_cfg)["train"]  # as sweeps hashed before the field existed
    assert swept_config(near)["train"]["rollback_to"] == "near-peak"
    assert sweep_name(near) != sweep_name(tiny_cfg)

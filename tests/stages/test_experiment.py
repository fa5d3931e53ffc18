"""`sao experiment`: every arm of every experiment is a valid config of its own; a quick experiment runs its arms as
sweeps under one MLflow parent and continues on a re-run (the table's statistics: tests/eval/test_experiment_stats.py)."""

import csv
from dataclasses import asdict

import pytest

from components.cli import main
from components.stages.experiment import EXPERIMENTS, SETTINGS, arm_configs, experiment_label
from components.stages.sweep import sweep_name


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("quick", [False, True])
def test_every_arm_is_a_config_of_its_own(name, setting, quick):
    configs = arm_configs(name, "tiny-cpu", [], setting, quick)
    assert [arm.name for arm, _ in configs] == [arm.name for arm in EXPERIMENTS[name].arms]
    assert len({sweep_name(cfg) for _, cfg in configs}) == len(configs)  # no two arms share their runs
    # The arms differ only where they say they do: one SFT policy for all of them.
    assert len({(cfg.sft, cfg.task, cfg.model, cfg.env.name) for _, cfg in configs}) == 1
    if setting in ("hard", "paper"):
        assert all(cfg.task.kinds == ("affine", "two_step") for _, cfg in configs)
    if setting == "paper":
        assert {cfg.rollout.engine_dtype for _, cfg in configs} == {"bfloat16"}
        steps = {cfg.train.max_steps for _, cfg in configs}
        assert steps == ({3} if quick else {180} if name == "style-shift" else {400})  # the phases keep their length


def test_the_experiments_set_what_their_claims_need():
    stability = {arm.name: cfg for arm, cfg in arm_configs("stability", "tiny-cpu", [])}
    control = stability.pop("sao-preset-lag")
    for cfg in stability.values():
        assert cfg.rollout.concurrency == 64 and cfg.train.max_staleness == 8  # preset: 16 and 2
        assert cfg.rollout.latency == "lognormal" and cfg.train.collapse_guard == "off"
    assert [cfg.train.algo for cfg in stability.values()] == ["grpo", "grpo-dis"] + ["sao"] * 9
    replayed = {name for name, cfg in stability.items() if cfg.algo.routing_replay == "r3"}
    guarded = {name for name, cfg in stability.items() if cfg.train.critic_warmup_steps == 20}
    parts = {"sao-r3-warmup", "sao-r3-clip10", "sao-r3-whiten", "sao-r3-evict", "sao-r3-lam"}
    assert replayed == {"sao-r3", "sao-r3-safeguards"} | parts
    assert guarded == {"sao-safeguards", "sao-r3-safeguards", "sao-r3-warmup"}
    # each part alone: the one safeguard it names differs from sao-r3, nothing else
    base = asdict(stability["sao-r3"])
    changed = {
        name: {f"{s}.{k}" for s in ("train", "algo") for k, v in asdict(cfg)[s].items() if base[s][k] != v}
        for name, cfg in stability.items()
        if name in parts
    }
    assert changed == {
        "sao-r3-warmup": {"train.critic_warmup_steps"},
        "sao-r3-clip10": {"train.critic_grad_clip"},
        "sao-r3-whiten": {"algo.normalize_advantages"},
        "sao-r3-evict": {"train.max_token_lag"},
        "sao-r3-lam": {"algo.lam_length_alpha"},
    }
    guard = stability["sao-r3-safeguards"]
    assert (guard.train.critic_grad_clip, guard.train.max_token_lag, guard.algo.normalize_advantages) == (10.0, 4, True)
    assert guard.algo.lam_length_alpha == 0.05 and stability["sao"].algo.lam_length_alpha == 0.0
    # The paper's conditions: the forced lag's 300 steps become 400, the control keeps the bf16 engine.
    paper = {arm.name: cfg for arm, cfg in arm_configs("stability", "tiny-cpu", [], "paper")}
    assert {cfg.train.max_steps for cfg in paper.values()} == {400}
    assert (paper["sao-preset-lag"].rollout.engine_dtype, paper["sao-preset-lag"].train.max_staleness) == (
        "bfloat16",
        2,
    )
    # The control differs from the sao arm only in the lag.
    assert (control.rollout.concurrency, control.train.max_staleness, control.rollout.latency) == (16, 2, "none")
    assert control.train.collapse_guard == "off" and control.train.min_lr_ratio == stability["sao"].train.min_lr_ratio
    ablation = {arm.name: cfg for arm, cfg in arm_configs("ablation", "tiny-cpu", [])}
    assert ablation["sao-no-skip-obs"].train.algo == "sao" and not ablation["sao-no-skip-obs"].algo.skip_observations
    assert ablation["sao"].algo.skip_observations
    assert (ablation["sao-r3"].algo.routing_replay, ablation["sao"].algo.routing_replay) == ("r3", "off")
    assert (ablation["sao-near-peak"].train.rollback_to, ablation["sao"].train.rollback_to) == ("near-peak", "onset")
    warm = {arm.name: cfg.value_pretrain.warm_start for arm, cfg in arm_configs("value-pretraining", "tiny-cpu", [])}
    assert warm == {"cold": False, "warm": True}
    # The user's overrides win over the experiment's, the arm's over the user's.
    (_, cfg), *_ = arm_configs("ablation", "tiny-cpu", ["train.max_steps=7", "algo.skip_observations=false"])
    assert cfg.train.max_steps == 7 and not cfg.algo.skip_observations
    lagged = dict(arm_configs("stability", "tiny-cpu", ["train.max_staleness=4", 'train.algo="ppo"']))
    assert [(c.train.max_staleness, c.train.algo) for c in lagged.values()] == [
        (4, "grpo"),
        (4, "grpo-dis"),
        *[(4, "ppo")] * 9,  # the sao arms take the preset's algorithm, which the user changed
        (2, "ppo"),
    ]
    style = dict(arm_configs("style-shift", "tiny-cpu", []))
    assert {cfg.env.name for cfg in style.values()} == {"style"}
    assert all(cfg.train.max_steps == 180 and cfg.train.collapse_guard == "off" for cfg in style.values())
    assert {cfg.env.judge for cfg in style.values()} == {"graded"}
    assert {arm.name: (cfg.train.algo, cfg.algo.kl_anchor) for arm, cfg in style.items()} == {
        "sao": ("sao", 0.0),
        "sao-running-mean": ("sao-running-mean", 0.0),
        "sao-kl-anchor": ("sao", 0.1),
        "sao-running-mean-kl-anchor": ("sao-running-mean", 0.1),
    }


def test_each_study_of_an_experiment_keeps_its_own_table():
    assert experiment_label("stability", []) == "stability"
    assert experiment_label("ablation", [], "hard", quick=True) == "ablation-hard-quick"
    assert experiment_label("ablation", [], preset="tiny-qwen3-cpu") == "ablation-tiny-qwen3-cpu"
    assert experiment_label("ablation", [], arms=["sao-k1", "sao"]) == "ablation-sao+sao-k1"
    lr = experiment_label("stability", ["train.policy_lr=1e-3"])
    assert lr.startswith("stability-") and lr != experiment_label("stability", ["train.policy_lr=2e-3"])


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"NAME: unknown experiment 'stabilty'.*'stability'"):
        arm_configs("stabilty", "tiny-cpu", [])
    with pytest.raises(ValueError, match=r"--setting: unknown setting 'harder'.*'hard'"):
        arm_configs("ablation", "tiny-cpu", [], setting="harder")


def test_a_quick_experiment_runs_its_arms_as_sweeps_under_one_parent_and_continues(seeded_home, prefect_api, capsys):
    from mlflow.tracking import MlflowClient

    home = seeded_home
    args = ["experiment", "value-pretraining", "--quick", "--home", str(home)]
    assert main(args) == 0
    out = capsys.readouterr().out
    root = home / "experiments" / "value-pretraining-quick"
    rows = list(csv.DictReader((root / "results.csv").open()))
    assert [(r["arm"], r["runs"]) for r in rows] == [("cold", "2"), ("warm", "2")]
    assert "| cold | 2 |" in out and (root / "curves.png").stat().st_size > 10_000
    for row in rows:  # each arm is a sweep of its own config, by the config's hash
        assert len(list(csv.DictReader((home / "sweeps" / row["sweep"] / "results.csv").open()))) == 2
    client = MlflowClient(f"sqlite:///{home.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("sao").experiment_id])
    parent = next(r for r in runs if r.data.tags.get("sao.experiment") == "value-pretraining-quick")
    arms = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["sao.sweep"] for r in arms) == sorted(r["sweep"] for r in rows)
    seeds = [r for r in runs if r.data.tags.get("mlflow.parentRunId") in {a.info.run_id for a in arms}]
    assert len(seeds) == 4
    assert {"results.md", "curves.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}

    # Re-running reads every finished seed back: no new runs, no seed's result written again.
    results = sorted((home / "sweeps").glob("*/seed-*/result.json"))
    written = [p.stat().st_mtime_ns for p in results]
    assert main([*args, "--arms", "warm"]) == 0
    assert "chuunibyou" not in capsys.readouterr().out  # no phase table outside style-shift
    assert [p.stat().st_mtime_ns for p in results] == written
    # The partial table has its own place; the whole one is left as it was.
    assert "| cold |" in (root / "results.md").read_text()
    assert "| cold |" not in (home / "experiments" / "value-pretraining-quick-warm" / "results.md").read_text()
    after = client.search_runs([client.get_experiment_by_name("sao").experiment_id])
    new = [r for r in after if r.info.run_id not in {r.info.run_id for r in runs}]
    assert [r.data.tags.get("sao.experiment") for r in new] == ["value-pretraining-quick-warm"]  # its parent only


def test_an_unknown_experiment_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["experiment", "claims", "--home", str(tmp_path)])
    assert exit_info.value.code == 2 and "unknown experiment 'claims'" in capsys.readouterr().err

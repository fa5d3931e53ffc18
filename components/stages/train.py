"""The train stage: the SFT policy bootstrapped if needed, then the RL run (`train.algo`: SAO or a baseline),
evaluated before and after on the held-out set unless the caller evaluates.

Metrics go to `runs/<preset>/<algo>.jsonl` under the home and to MLflow; checkpoints to the artifact store. Under
torchrun rank 0 does all of this while the other ranks only join the SFT and training steps (stages/ranks.py).
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace
from pathlib import Path

from components.config import Config, apply_overrides
from components.envs.registry import build_env
from components.stages.evaluate import run_eval
from components.stages.home import Log, publish
from components.stages.recipes import fingerprint
from components.stages.sft import join_sft, run_sft, sft_eval
from components.stages.value_pretrain import critic_origin, join_starting_critic, starting_critic, with_critic
from components.tracking import DiskTracker, NullTracker, mlflow_uri, open_tracker
from components.training.engines.collective import is_driver, launched_world_size
from components.training.rl.checkpoint import checkpoint_store
from components.training.rl.parts import refuse_an_earlier_run
from components.training.rl.recording import Recording
from components.training.rl.replay import replay
from components.training.rl.trainer import train


def run_train(
    cfg: Config,
    home: Path,
    resume: bool = False,
    log: Log = print,
    force_sft: bool = False,
    parent_run_id: str | None = None,
    on_checkpoint=None,
    evaluate: bool = True,
) -> dict:
    """`sao train`: the SFT policy (trained first if needed) and the critic to start from (`starting_critic`: the
    pretrained one when `value_pretrain.warm_start`, pretrained first if needed, as the pipeline does), then training
    with `cfg.train.algo`, evaluated before and after on the held-out set (`evaluate=False`: the caller evaluates).
    Metrics go to `runs/<preset>/<algo>.jsonl` and to MLflow (`tracking.*`, nested under `parent_run_id`);
    `on_checkpoint(step, uri)` is called for every complete checkpoint.

    Under torchrun, rank 0 does everything above while the other ranks only join the SFT, value-pretraining and
    training steps."""
    if not is_driver():
        setup = build_env(cfg, lambda _: None)
        sft_dir = join_sft(cfg, home)  # rank 0's SFT policy (its steps too, with sft.backend = "deepspeed")
        cfg = with_critic(cfg, join_starting_critic(cfg, home, sft_dir))
        train(cfg, setup, sft_dir, home, NullTracker(), resume=resume, log=lambda _: None)
        return {}
    setup = build_env(cfg, log)
    refuse_an_earlier_run(checkpoint_store(cfg, home), resume)  # before any SFT or pretraining is spent
    sft_dir = run_sft(cfg, home, force=force_sft, log=log)  # tells the other ranks where it is
    critic = starting_critic(cfg, home, sft_dir, log)
    log(f"train: starts from the policy {sft_dir} and {critic_origin(cfg, critic)}")
    cfg = with_critic(cfg, critic)
    before = sft_eval(cfg, sft_dir, home, log) if evaluate else None
    log(
        f"train: {cfg.train.algo}, {cfg.train.max_steps} steps x {cfg.train.batch_size} trajectories, "
        f"{'sync' if cfg.train.sync else 'async'}, backend {cfg.train.backend}, {launched_world_size()} process(es)"
        + (f"; SFT held-out accuracy {before:.1%}" if evaluate else "")
    )
    run_name = f"{cfg.name}/{cfg.train.algo}"
    jsonl = home / "runs" / cfg.name / f"{cfg.train.algo}.jsonl"
    tracker = open_tracker(cfg.tracking, home, run_name, jsonl, parent_run_id=parent_run_id)
    accuracy_key = f"eval/{cfg.env.name}/accuracy"
    failed = True
    try:
        result = train(cfg, setup, sft_dir, home, tracker, resume=resume, log=log, on_checkpoint=on_checkpoint)
        publish(cfg.store, home, str(result.policy_dir.relative_to(home)), log)
        if not evaluate:
            failed = False
            return _summary(result, tracker, jsonl, cfg.train.batch_size)
        after = run_eval(cfg, result.policy_dir, home, f"{cfg.train.algo}-eval", log=log)
        # Logged after training: a resumed run rewinds its tracker first, so nothing it logged is duplicated.
        tracker.log_metrics({accuracy_key: before}, 0)
        tracker.log_metrics({accuracy_key: after.accuracy}, result.version)
        failed = False
    finally:
        tracker.close(failed)
    log(
        f"train: held-out accuracy {before:.1%} -> {after.accuracy:.1%} after {result.version} policy "
        f"versions ({result.policy_dir})"
    )
    log(
        f"reports: {home / 'reports'}; metrics: {home / 'runs' / cfg.name}"
        + (f", MLflow at {mlflow_uri(cfg.tracking, home)}" if cfg.tracking.backend == "mlflow" else "")
    )
    return {"before": before, "after": after.accuracy, **_summary(result, tracker, jsonl, cfg.train.batch_size)}


def _summary(result, tracker, jsonl: Path, batch_size: int) -> dict:
    """What a training run hands on: version, rollbacks, the policy, its MLflow run, and from the run's JSON lines
    (the whole run, across resumes): explained variance at step 1, trajectories/s over wall-clock time, trainer
    idle fraction."""
    rows = [r for r in DiskTracker.read(jsonl) if "step" in r] if jsonl.exists() else []
    steps = [r for r in rows if "reward/mean" in r["metrics"]]
    rate = None
    if len(steps) >= 2 and steps[-1]["time"] > steps[0]["time"]:
        rate = (len(steps) - 1) * batch_size / (steps[-1]["time"] - steps[0]["time"])
    return {
        "version": result.version,
        "rollbacks": result.rollbacks,
        "policy_dir": result.policy_dir,
        "run_id": getattr(tracker, "run_id", None),
        "trajectories_per_s": rate,
        "idle_frac": steps[-1]["metrics"].get("trainer/idle_frac") if steps else None,
        "explained_variance_step1": steps[0]["metrics"].get("critic/explained_variance") if steps else None,
    }


def latest_checkpoint(cfg: Config, home: Path) -> int | None:
    """The step of this config's newest complete checkpoint in the store (None: none yet)."""
    return checkpoint_store(cfg, home).latest_step()


def run_replay(
    run: Path, home: Path, overrides: list[str], stop_at: int | None = None, evaluate: bool = True, log: Log = print
) -> dict:
    """`sao train --replay RUN`: the recorded run at `run` (its home, a sweep seed's home, or its `batches/`)
    trained again on its recorded batches, in `home/replays/<run>-<overrides>/` (rebuilt every time). Without
    overrides the replay must reproduce the run: every step's recorded metrics are compared and the summary says
    whether they are identical. With overrides it is a study of the same batches under a changed config."""
    recording = Recording.open(run)
    recorded = Config(**copy.deepcopy(recording.config))
    cfg = Config(**apply_overrides(copy.deepcopy(recording.config), list(overrides)))
    strict = _same_update(cfg, recorded)
    source = recording.root.resolve()
    label = f"{source.parent.name}-{fingerprint({'run': str(source), 'set': sorted(overrides)})}"
    replay_home = home / "replays" / label
    shutil.rmtree(replay_home, ignore_errors=True)  # derived data: a replay starts over every time
    cfg = replace(cfg, tracking=replace(cfg.tracking, prometheus_port=0))  # the recorded run may still be serving it
    log(
        f"replay: {len(recording.steps)} recorded step(s) of {recording.root}"
        + (f" with {' '.join(overrides)}" if not strict else ", as recorded")
        + f"; replay home {replay_home}"
    )
    tracker = open_tracker(cfg.tracking, home, f"replay/{label}", replay_home / "metrics.jsonl")
    failed = True
    try:
        result = replay(recording, cfg, build_env(cfg, log), replay_home, tracker, strict, stop_at, log)
        summary = {
            "home": replay_home,
            "version": result.train.version,
            "rollbacks": result.train.rollbacks,
            "policy_dir": result.train.policy_dir,
            "identical_steps": result.comparison.identical,
            "steps": result.comparison.steps,
        }
        log(result.comparison.summary())
        if evaluate:
            accuracy = run_eval(cfg, result.train.policy_dir, replay_home, "replay-eval", log=log).accuracy
            tracker.log_metrics({f"eval/{cfg.env.name}/accuracy": accuracy}, result.train.version)
            summary["accuracy"] = accuracy
            log(f"replay: held-out accuracy {accuracy:.1%} after version {result.train.version}")
        failed = False
    finally:
        tracker.close(failed)
    return summary


def _same_update(a: Config, b: Config) -> bool:
    """Whether two configs train the same updates: equal but for where results go (tracking, the store) and
    whether batches are recorded."""

    def essential(cfg: Config) -> Config:
        return replace(cfg, tracking=b.tracking, store=b.store, train=replace(cfg.train, record_batches=True))

    return essential(a) == essential(b)

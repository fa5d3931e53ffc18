"""The jobs the flows (flows/) and the CLI run: SFT, evaluation and training. Each reads and writes the run home,
and publishes what it made to the artifact store when one is configured (`store.uri` or `$SAO_STORE_URI`);
the other stages are in components/pipeline.

Home layout (`--home`, default `./.sao` or `$SAO_HOME`); the same keys in the store:

    data/sft-<env>-<hash>/          gated teacher traces for SFT (hash of the env, task and teacher config)
    models/critic-<env>-<hash>/     the pretrained critic (components/pipeline/critic.py)
    models/sft-<env>/               HF model directory of the SFT policy (complete once `_COMPLETE` exists)
    models/<preset>-<algo>-policy/  the trained policy
    checkpoints/<preset>/step-N/    verified training checkpoints (`sao train --resume` continues the newest)
    reports/<name>.json, .parquet   evaluations: the numbers, and every trajectory
    runs/<preset>/<algo>.jsonl      metrics of `sao train`, one JSON line per step (home only)
    mlflow.db, mlartifacts/         the MLflow store when no tracking URI is configured (home only)

A job that finds an artifact missing in the home but complete in the store fetches it (verified against its
manifest) instead of making it again: `sao train --resume` on a machine with an empty home continues from the
store alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from components.agent.runner import episode_limits
from components.config import Config, to_dict
from components.contracts.task import Task
from components.contracts.trajectory import write_trajectories
from components.data.traces import read_traces
from components.envs.registry import build_env
from components.eval.evaluate import EvalReport, evaluate
from components.models import build_policy, build_tokenizer, load_policy, load_tokenizer, save_model_dir
from components.models import stop_token_ids
from components.rollout.embedded import EmbeddedEngine
from components.pipeline.distill import data_recipe, run_distill
from components.pipeline.store import fetch, fingerprint, publish  # noqa: F401 (fingerprint: for callers)
from components.storage import atomic_dir, is_complete
from components.storage import weights_fingerprint, write_json
from components.training.sft import train_sft

Log = Callable[[str], None]
_EVAL_TASK_FIELDS = ("kinds", "operand_max", "eval_size", "seed", "max_turns", "max_new_tokens")


def default_home() -> Path:
    return Path(os.environ.get("SAO_HOME", ".sao"))


def run_sft(cfg: Config, home: Path, force: bool = False, log: Log = print) -> Path:
    """Train the SFT policy from scratch (or from `model.path`) and save it as an HF model directory."""
    key = f"models/sft-{cfg.env.name}"
    out, recipe = home / key, sft_recipe(cfg)
    if not force and (is_complete(out) or fetch(cfg, home, key, log)):
        saved = json.loads((out / "sao_sft.json").read_text())
        if saved.get("recipe") == recipe:
            log(f"sft: reusing the complete SFT policy at {out} (--force retrains)")
            publish(cfg, home, key, log, again=False)
            return out
        log(f"sft: the policy at {out} was trained with another config; retraining")
    traces = read_traces(run_distill(cfg, home, log))
    tokenizer = load_tokenizer(cfg.model.path) if cfg.model.path else build_tokenizer()
    model = build_policy(cfg.model, tokenizer, seed=cfg.sft.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"sft: {type(model).__name__} with {n_params / 1e6:.2f}M parameters, {len(traces)} traces, "
        f"{cfg.sft.steps} steps x {cfg.sft.batch_size}")
    result = train_sft(model, tokenizer, traces, cfg.sft, log)
    with atomic_dir(out) as tmp:
        save_model_dir(model, tokenizer, tmp)
        write_json(tmp / "sao_sft.json", {"recipe": recipe, "result": asdict(result)})
    log(f"sft: saved {out}")
    publish(cfg, home, key, log)
    return out


def sft_recipe(cfg: Config) -> dict:
    """What an SFT policy depends on (its dataset's recipe, the model and SFT settings); a saved policy is reused
    only when its recipe equals this."""
    # JSON round trip so that it compares equal to the copy saved next to the weights (tuples become lists).
    return json.loads(json.dumps({"model": to_dict(cfg.model), **data_recipe(cfg), "sft": to_dict(cfg.sft)}))


def run_eval(cfg: Config, model_dir: Path, home: Path, name: str, samples: int = 1, log: Log = print,
             tasks: list[Task] | None = None, eval_set: str | None = None) -> EvalReport:
    """Evaluation of `model_dir` in `cfg.env` on the episode path (greedy, plus `samples` sampled episodes per task
    when > 1): on `tasks` (a benchmark, named `eval_set`) or the environment's held-out set; writes
    `reports/<name>.json` and every trajectory to `reports/<name>.parquet`."""
    setup = build_env(cfg)  # as a run starts: style prefers the schedule's first style
    tasks = tasks if tasks is not None else setup.eval_tasks()
    log(f"eval: {len(tasks)} {eval_set or cfg.env.name + ' held-out'} tasks x {samples} sample(s), {model_dir}")
    tokenizer = load_tokenizer(model_dir)
    engine = EmbeddedEngine(load_policy(model_dir), tokenizer, max_batch=cfg.rollout.max_batch).start()
    try:
        report = evaluate(engine, tokenizer, setup.env, tasks, episode_limits(cfg), samples,
                          concurrency=cfg.rollout.max_batch, stop_token_ids=tuple(stop_token_ids(tokenizer)),
                          seed=cfg.task.seed)
    finally:
        engine.shutdown()
    trajectories = report.greedy + ([t for s in report.sampled for t in s] if samples > 1 else [])
    write_trajectories(home / "reports" / f"{name}.parquet", trajectories)
    write_json(home / "reports" / f"{name}.json", {
        **report.summary(),
        "model": str(model_dir),
        "weights": weights_fingerprint(model_dir),
        "eval_task": _eval_task(cfg) if eval_set is None else {"benchmark": eval_set},
        "samples_text": [{"task": t.prompt_id, "output": tokenizer.decode(t.token_ids[t.prompt_len:]),
                          "reward": t.reward, "finish_reason": t.finish_reason} for t in report.greedy[:20]],
    })
    return report


def sft_eval(cfg: Config, sft_dir: Path, home: Path, log: Log = print) -> float:
    """Held-out accuracy of the SFT policy, reusing `reports/sft-eval.json` when it scored these exact weights
    on this held-out set."""
    path = home / "reports" / "sft-eval.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("weights") == weights_fingerprint(sft_dir) and saved.get("eval_task") == _eval_task(cfg):
            log(f"eval: reusing {path} ({saved['accuracy']:.1%})")
            return saved["accuracy"]
    return run_eval(cfg, sft_dir, home, "sft-eval", log=log).accuracy


def _eval_task(cfg: Config) -> dict:
    """What decides the held-out episodes: the environment and the task fields that shape them."""
    task = {k: v for k, v in to_dict(cfg.task).items() if k in _EVAL_TASK_FIELDS}
    return json.loads(json.dumps({"env": to_dict(cfg.env), "task": task}))


def run_train(cfg: Config, home: Path, resume: bool = False, log: Log = print, force_sft: bool = False,
              parent_run_id: str | None = None, on_checkpoint=None, evaluate: bool = True) -> dict:
    """`sao train`: bootstrap the SFT policy if needed, train with `cfg.train.algo` (the critic from
    `train.critic_path` when set), evaluate before and after on the held-out set (`evaluate=False`: the caller evaluates).
    Metrics go to `runs/<preset>/<algo>.jsonl` and to MLflow (`tracking.*`, nested under `parent_run_id`);
    `on_checkpoint(step, uri)` is called for every complete checkpoint.

    Under torchrun, rank 0 does everything above while the other ranks only join the training steps."""
    from components.tracking import NullTracker, mlflow_uri, open_tracker
    from components.training.collective import SOLO, from_environment, launched_world_size
    from components.training.engines import init_single_process_group
    from components.training.trainer import train

    setup = build_env(cfg)
    comm = SOLO
    if launched_world_size() > 1:
        init_single_process_group()
        comm = from_environment()
    if comm.rank != 0:
        sft_dir = Path(comm.broadcast(None))  # waits for rank 0's SFT policy
        train(cfg, setup, sft_dir, home, NullTracker(), resume=resume, log=lambda _: None)
        return {}
    sft_dir = run_sft(cfg, home, force=force_sft, log=log)
    comm.broadcast(str(sft_dir))  # releases the other ranks (a no-op in one process)
    before = sft_eval(cfg, sft_dir, home, log) if evaluate else None
    log(f"train: {cfg.train.algo}, {cfg.train.max_steps} steps x {cfg.train.batch_size} trajectories, "
        f"{'sync' if cfg.train.sync else 'async'}, backend {cfg.train.backend}, {comm.world} process(es)"
        + (f"; SFT held-out accuracy {before:.1%}" if evaluate else ""))
    run_name = f"{cfg.name}/{cfg.train.algo}"
    jsonl = home / "runs" / cfg.name / f"{cfg.train.algo}.jsonl"
    tracker = open_tracker(cfg.tracking, home, run_name, jsonl, parent_run_id=parent_run_id)
    accuracy_key = f"eval/{cfg.env.name}/accuracy"
    failed = True
    try:
        result = train(cfg, setup, sft_dir, home, tracker, resume=resume, log=log, on_checkpoint=on_checkpoint)
        publish(cfg, home, str(result.policy_dir.relative_to(home)), log)
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
    log(f"train: held-out accuracy {before:.1%} -> {after.accuracy:.1%} after {result.version} policy "
        f"versions ({result.policy_dir})")
    log(f"reports: {home / 'reports'}; metrics: {home / 'runs' / cfg.name}"
        + (f", MLflow at {mlflow_uri(cfg.tracking, home)}" if cfg.tracking.backend == "mlflow" else ""))
    return {"before": before, "after": after.accuracy, **_summary(result, tracker, jsonl, cfg.train.batch_size)}


def _summary(result, tracker, jsonl: Path, batch_size: int) -> dict:
    """What a training run hands on: version, rollbacks, the policy, its MLflow run, and from the run's JSON lines
    (the whole run, across resumes): explained variance at step 1, trajectories/s over wall-clock time, trainer
    idle fraction."""
    from components.tracking import DiskTracker

    rows = [r for r in DiskTracker.read(jsonl) if "step" in r] if jsonl.exists() else []
    steps = [r for r in rows if "reward/mean" in r["metrics"]]
    rate = None
    if len(steps) >= 2 and steps[-1]["time"] > steps[0]["time"]:
        rate = (len(steps) - 1) * batch_size / (steps[-1]["time"] - steps[0]["time"])
    return {"version": result.version, "rollbacks": result.rollbacks, "policy_dir": result.policy_dir,
            "run_id": getattr(tracker, "run_id", None), "trajectories_per_s": rate,
            "idle_frac": steps[-1]["metrics"].get("trainer/idle_frac") if steps else None,
            "explained_variance_step1": steps[0]["metrics"].get("critic/explained_variance") if steps else None}

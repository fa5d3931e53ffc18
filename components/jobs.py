"""End-to-end jobs behind the CLI (and, later, the Prefect flows): each step reads and writes the run home, and
publishes what it made to the artifact store when one is configured (`store.uri` or `$SAO_STORE_URI`).

Home layout (`--home`, default `./.sao` or `$SAO_HOME`); the same keys in the store:

    data/sft-<env>-<hash>/          teacher traces for SFT (hash of the env and task config)
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

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from components.agent.runner import episode_limits
from components.config import Config, to_dict
from components.contracts.trajectory import write_trajectories
from components.data.traces import read_traces, write_traces
from components.envs.registry import build_env, sft_traces
from components.eval.evaluate import EvalReport, evaluate
from components.models import build_policy, build_tokenizer, load_policy, load_tokenizer, save_model_dir
from components.models import stop_token_ids
from components.rollout.embedded import EmbeddedEngine
from components.storage import ArtifactStore, atomic_dir, is_complete, mark_complete, open_store, resolve_store_uri
from components.storage import weights_fingerprint, write_json
from components.training.sft import train_sft

Log = Callable[[str], None]
_SFT_TASK_FIELDS = ("kinds", "operand_max", "train_size", "seed", "teacher_mental_max")
_EVAL_TASK_FIELDS = ("kinds", "operand_max", "eval_size", "seed", "max_turns", "max_new_tokens")


def default_home() -> Path:
    return Path(os.environ.get("SAO_HOME", ".sao"))


def artifact_store(cfg: Config, home: Path) -> ArtifactStore | None:
    """The configured artifact store, or None when it is the run home itself (the default: nothing to copy)."""
    uri = resolve_store_uri(cfg.store.uri, home)
    if not uri.startswith("s3://") and Path(uri).resolve() == Path(home).resolve():
        return None
    return open_store(uri)


def publish(cfg: Config, home: Path, key: str, log: Log = print, again: bool = True) -> None:
    """Copy the complete artifact `home/key` to the store (a no-op when the store is the home); with
    `again=False`, only when the store does not hold it complete yet."""
    store = artifact_store(cfg, home)
    if store is not None and (again or not store.is_complete(key)):
        log(f"store: published {store.put_dir(home / key, key)}")


def fetch(cfg: Config, home: Path, key: str, log: Log = print) -> bool:
    """Fetch the artifact `key` from the store into `home/key` when the store has it complete; True if so."""
    store = artifact_store(cfg, home)
    if store is None or not store.is_complete(key):
        return False
    local = home / key
    store.get_dir(key, local)  # verified against the manifest, or it raises
    mark_complete(local, fetched_from=store.uri(key))
    log(f"store: fetched {store.uri(key)}")
    return True


def build_sft_data(cfg: Config, home: Path, log: Log = print) -> Path:
    """The environment's teacher traces for SFT; reused (or fetched from the store) when the config that
    shapes them is unchanged."""
    recipe = sft_recipe(cfg)
    key = f"data/sft-{cfg.env.name}-{fingerprint({'env': recipe['env'], 'task': recipe['task']})}"
    path = home / key / "traces.parquet"
    if is_complete(home / key) or fetch(cfg, home, key, log):
        log(f"data: reusing {path}")
        publish(cfg, home, key, log, again=False)
        return path
    traces = sft_traces(cfg)
    with atomic_dir(home / key) as tmp:
        write_traces(tmp / "traces.parquet", traces)
    log(f"data: wrote {len(traces)} {cfg.env.name} teacher traces to {path}")
    publish(cfg, home, key, log)
    return path


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
    traces = read_traces(build_sft_data(cfg, home, log))
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
    """What an SFT policy depends on; a saved policy is reused only when its recipe equals this."""
    # Only the task fields that shape the teacher traces: the eval set size or turn limits do not change SFT.
    task = {k: v for k, v in to_dict(cfg.task).items() if k in _SFT_TASK_FIELDS}
    env = {"name": cfg.env.name, "tasks": cfg.env.tasks}
    # JSON round trip so that it compares equal to the copy saved next to the weights (tuples become lists).
    return json.loads(json.dumps({"model": to_dict(cfg.model), "env": env, "task": task, "sft": to_dict(cfg.sft)}))


def run_eval(cfg: Config, model_dir: Path, home: Path, name: str, samples: int = 1, log: Log = print) -> EvalReport:
    """Held-out evaluation of `model_dir` in `cfg.env` on the episode path (greedy, plus `samples` sampled
    episodes per task when > 1); writes `reports/<name>.json` and every trajectory to `reports/<name>.parquet`."""
    setup = build_env(cfg)  # as a run starts: style prefers the schedule's first style
    tasks = setup.eval_tasks()
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
        "eval_task": _eval_task(cfg),
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


def fingerprint(data: dict) -> str:
    """Short sha256 of JSON data (keys sorted): names what a config produced."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def run_pipeline(cfg: Config, home: Path, force: bool = False, log: Log = print) -> dict:
    """`sao run` (`make run`): SFT, held-out eval, RL with `cfg.train.algo`, held-out eval.

    Re-running continues: a complete SFT policy with the same recipe is reused and training resumes from its
    newest checkpoint (a finished run only re-evaluates). `force` retrains both from scratch; it removes this
    preset's training checkpoints, which is what it was asked to do."""
    if force:
        from components.training.trainer import checkpoint_store

        checkpoints = checkpoint_store(cfg, home)
        for step in checkpoints.steps():
            checkpoints.store.delete(checkpoints.key(step))
    return run_train(cfg, home, resume=True, force_sft=force, log=log)


def run_train(cfg: Config, home: Path, resume: bool = False, log: Log = print, force_sft: bool = False) -> dict:
    """`sao train`: bootstrap the SFT policy if needed, train with `cfg.train.algo`, evaluate before and after.
    Metrics go to `runs/<preset>/<algo>.jsonl` and to MLflow (`tracking.*`).

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
    before = sft_eval(cfg, sft_dir, home, log)
    log(f"train: {cfg.train.algo}, {cfg.train.max_steps} steps x {cfg.train.batch_size} trajectories, "
        f"{'sync' if cfg.train.sync else 'async'}, backend {cfg.train.backend}, {comm.world} "
        f"process(es); SFT held-out accuracy {before:.1%}")
    run_name = f"{cfg.name}/{cfg.train.algo}"
    tracker = open_tracker(cfg.tracking, home, run_name, home / "runs" / cfg.name / f"{cfg.train.algo}.jsonl")
    accuracy_key = f"eval/{cfg.env.name}/accuracy"
    failed = True
    try:
        result = train(cfg, setup, sft_dir, home, tracker, resume=resume, log=log)
        publish(cfg, home, str(result.policy_dir.relative_to(home)), log)
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
    return {"before": before, "after": after.accuracy, "version": result.version, "rollbacks": result.rollbacks}

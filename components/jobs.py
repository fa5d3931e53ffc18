"""End-to-end jobs behind the CLI (and, later, the Prefect flows): each step reads and writes the run home.

Home layout (`--home`, default `./.sao` or `$SAO_HOME`):

    data/tir_train-<hash>.parquet   teacher traces for SFT (hash of the task config)
    models/sft-policy/              HF model directory of the SFT policy (complete once `_COMPLETE` exists)
    reports/sft-eval.json           held-out evaluation of the SFT policy
    checkpoints/<preset>/step-N/    verified training checkpoints (`sao train --resume` continues the newest)
    runs/<preset>/<algo>.jsonl      metrics of `sao train`, one JSON line per step
    mlflow.db, mlartifacts/         the MLflow store when no tracking URI is configured
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from components.config import Config, to_dict
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.data.traces import read_traces, write_traces
from components.envs.python_tool import PythonTool
from components.eval.tir_eval import EvalReport, evaluate_tir
from components.models import build_policy, build_tokenizer, load_policy, load_tokenizer, save_model_dir
from components.storage import atomic_dir, is_complete, weights_fingerprint, write_json
from components.training.sft import train_sft

Log = Callable[[str], None]
_BENCHMARK = "tir_math"  # the held-out set's name in `eval/<benchmark>/accuracy`
_SFT_TASK_FIELDS = ("kinds", "operand_max", "train_size", "seed", "teacher_mental_max")
_EVAL_TASK_FIELDS = ("kinds", "operand_max", "eval_size", "seed", "max_turns", "max_new_tokens")


def default_home() -> Path:
    return Path(os.environ.get("SAO_HOME", ".sao"))


def build_sft_data(cfg: Config, home: Path, log: Log = print) -> Path:
    """Generate the teacher traces of the training split; reused when the task config is unchanged."""
    path = home / "data" / f"tir_train-{fingerprint(sft_recipe(cfg)['task'])}.parquet"
    if path.exists():
        log(f"data: reusing {path}")
        return path
    problems = generate_problems(cfg.task.kinds, cfg.task.train_size, cfg.task.seed, cfg.task.operand_max, "train")
    write_traces(path, [teacher_trace(p, cfg.task.teacher_mental_max) for p in problems])
    log(f"data: wrote {len(problems)} teacher traces to {path}")
    return path


def run_sft(cfg: Config, home: Path, force: bool = False, log: Log = print) -> Path:
    """Train the SFT policy from scratch (or from `model.path`) and save it as an HF model directory."""
    out = home / "models" / "sft-policy"
    recipe = sft_recipe(cfg)
    if is_complete(out) and not force:
        saved = json.loads((out / "sao_sft.json").read_text())
        if saved.get("recipe") == recipe:
            log(f"sft: reusing the complete SFT policy at {out} (--force retrains)")
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
    return out


def sft_recipe(cfg: Config) -> dict:
    """What an SFT policy depends on; a saved policy is reused only when its recipe equals this."""
    # Only the task fields that shape the teacher traces: the eval set size or turn limits do not change SFT.
    task = {k: v for k, v in to_dict(cfg.task).items() if k in _SFT_TASK_FIELDS}
    # JSON round trip so that it compares equal to the copy saved next to the weights (tuples become lists).
    return json.loads(json.dumps({"model": to_dict(cfg.model), "task": task, "sft": to_dict(cfg.sft)}))


def run_eval(cfg: Config, model_dir: Path, home: Path, name: str, log: Log = print) -> EvalReport:
    """Greedy held-out evaluation with real (sandboxed) tool calls; writes `reports/<name>.json`."""
    model, tokenizer = load_policy(model_dir), load_tokenizer(model_dir)
    problems = generate_problems(cfg.task.kinds, cfg.task.eval_size, cfg.task.seed, cfg.task.operand_max, "eval")
    report = evaluate_tir(model, tokenizer, problems, PythonTool(), cfg.task.max_turns, cfg.task.max_new_tokens)
    write_json(home / "reports" / f"{name}.json", {
        "model": str(model_dir),
        "weights": weights_fingerprint(model_dir),
        "eval_task": _eval_task(cfg),
        "accuracy": report.accuracy,
        "n": report.n,
        "tool_calls_mean": report.tool_calls_mean,
        "finish_reasons": report.finish_reasons,
        "seconds": report.seconds,
        "samples": [{"problem": ep.problem.question, "answer": ep.problem.answer, "output": ep.text,
                     "correct": ep.correct, "finish_reason": ep.finish_reason} for ep in report.episodes[:20]],
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
    return run_eval(cfg, sft_dir, home, "sft-eval", log).accuracy


def _eval_task(cfg: Config) -> dict:
    return json.loads(json.dumps({k: v for k, v in to_dict(cfg.task).items() if k in _EVAL_TASK_FIELDS}))


def fingerprint(data: dict) -> str:
    """Short sha256 of JSON data (keys sorted): names what a config produced."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def run_pipeline(cfg: Config, home: Path, force: bool = False, log: Log = print) -> dict:
    """`sao run` (`make run`): SFT, held-out eval, RL with `cfg.train.algo`, held-out eval.

    Re-running continues: a complete SFT policy with the same recipe is reused and training resumes from its
    newest checkpoint (a finished run only re-evaluates). `force` retrains both from scratch; it removes this
    preset's training checkpoints, which is what it was asked to do."""
    if force:
        shutil.rmtree(home / "checkpoints" / cfg.name, ignore_errors=True)
    return run_train(cfg, home, resume=True, force_sft=force, log=log)


def run_train(cfg: Config, home: Path, resume: bool = False, log: Log = print, force_sft: bool = False) -> dict:
    """`sao train`: bootstrap the SFT policy if needed, train with `cfg.train.algo`, evaluate before and after.
    Metrics go to `runs/<preset>/<algo>.jsonl` and to MLflow (`tracking.*`).

    Under torchrun, rank 0 does everything above while the other ranks only join the training steps."""
    from components.tracking import NullTracker, mlflow_uri, open_tracker
    from components.training.collective import SOLO, from_environment, launched_world_size
    from components.training.engines import init_single_process_group
    from components.training.trainer import train

    comm = SOLO
    if launched_world_size() > 1:
        init_single_process_group()
        comm = from_environment()
    if comm.rank != 0:
        sft_dir = Path(comm.broadcast(None))  # waits for rank 0's SFT policy
        train(cfg, sft_dir, home, NullTracker(), resume=resume, log=lambda _: None)
        return {}
    sft_dir = run_sft(cfg, home, force=force_sft, log=log)
    comm.broadcast(str(sft_dir))  # releases the other ranks (a no-op in one process)
    before = sft_eval(cfg, sft_dir, home, log)
    log(f"train: {cfg.train.algo}, {cfg.train.max_steps} steps x {cfg.train.batch_size} trajectories, "
        f"{'sync' if cfg.train.sync else 'async'}, backend {cfg.train.backend}, {comm.world} "
        f"process(es); SFT held-out accuracy {before:.1%}")
    run_name = f"{cfg.name}/{cfg.train.algo}"
    tracker = open_tracker(cfg.tracking, home, run_name, home / "runs" / cfg.name / f"{cfg.train.algo}.jsonl")
    accuracy_key = f"eval/{_BENCHMARK}/accuracy"
    failed = True
    try:
        result = train(cfg, sft_dir, home, tracker, resume=resume, log=log)
        after = run_eval(cfg, result.policy_dir, home, f"{cfg.train.algo}-eval", log)
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

"""`evaluate`: a checkpoint (or a model directory) on a benchmark through the one episode path, then the registry.

    checkpoint step N -> HF directory -> episodes (greedy + K samples) -> accuracy, avg@K, pass@K
                      -> MLflow version `candidate`; `champion` when it beats the champion on this set

Benchmarks are the user's files in a public format (AIME 2025, HMMT, BeyondAIME, IMOAnswerBench; JSONL or
Parquet, local or s3://; components/eval/benchmarks.py); the default is the environment's held-out set. A
deployment trigger runs this flow for every `sao.checkpoint.saved` event with `checkpoint_step` from its payload.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components import jobs
from components.pipeline.checkpoints import export_checkpoint
from components.pipeline.model_registry import promote
from flows.common import IO_RETRIES, NO_CACHE, context, markdown_table, tracked


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def load_tasks(cfg, benchmark: str, tasks: str) -> tuple[list | None, str]:
    """(tasks, eval set name): a benchmark file (I/O: retried), or None for the environment's held-out set."""
    if not tasks:
        return None, f"{cfg.env.name}-heldout"
    from components.eval.benchmarks import load_benchmark

    return load_benchmark(benchmark or "auto", tasks), f"{benchmark or 'benchmark'}:{Path(tasks).name}"


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def model_to_score(cfg, home, model: str, checkpoint_step: int | None, log) -> tuple[Path, str | None, str]:
    """(HF directory, the URI to register or None, a name for reports): a checkpoint, a directory, or by default
    the newest checkpoint of this config (else the SFT policy, which is not registered)."""
    from components.training.trainer import checkpoint_store

    if model:
        return Path(model), None, Path(model).name
    store = checkpoint_store(cfg, home)
    step = checkpoint_step if checkpoint_step is not None else store.latest_step()
    sft_dir = jobs.run_sft(cfg, home, log=log)  # reused when complete; a checkpoint is rebuilt on its config
    if step is None:
        return sft_dir, None, "sft"
    return export_checkpoint(cfg, home, step, sft_dir, log), store.store.uri(store.key(step)), f"step-{step}"


@task(cache_policy=NO_CACHE)
def score(cfg, model_dir, home, name, samples, tasks, eval_set, log):
    return jobs.run_eval(cfg, model_dir, home, name, samples, log, tasks=tasks, eval_set=eval_set)


@flow(name="evaluate")
def evaluate(preset: str = "tiny-cpu", overrides: list[str] | None = None, home: str | None = None,
             model: str = "", checkpoint_step: int | None = None, benchmark: str = "", tasks: str = "",
             samples: int = 1, register_model: bool = True, parent_run_id: str | None = None) -> dict:
    """Returns the scores, the eval set, and the registry decision (when a checkpoint was scored)."""
    ctx = context(preset, overrides, home)
    cfg = ctx.cfg
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")
    with tracked(ctx, "evaluate", parent_run_id) as run:
        task_list, eval_set = load_tasks(cfg, benchmark, tasks)
        model_dir, source, label = model_to_score(cfg, ctx.home, model, checkpoint_step, ctx.log)
        name = f"eval-{label}" + (f"-{benchmark or 'benchmark'}" if tasks else "")
        report = score(cfg, model_dir, ctx.home, name, samples, task_list, eval_set, ctx.log)
        k, prefix = report.samples, f"eval/{(benchmark or 'benchmark') if tasks else cfg.env.name}"
        metrics = {f"{prefix}/accuracy": report.accuracy, f"{prefix}/avg_at_{k}": report.avg_at_k,
                   f"{prefix}/pass_at_{k}": report.pass_at_k}
        run.log_metrics(metrics, step=checkpoint_step or 0)
        result = {"eval_set": eval_set, "n": report.n, "accuracy": report.accuracy, "samples": k,
                  "avg_at_k": report.avg_at_k, "pass_at_k": report.pass_at_k, "model": str(model_dir),
                  "report": str(ctx.home / "reports" / f"{name}.json")}
        if register_model and source is not None and cfg.tracking.backend == "mlflow":
            result.update(_register(cfg, run, source, report.accuracy, eval_set, label))
    create_markdown_artifact(key="evaluate", markdown=markdown_table([result]))
    ctx.log(f"eval: {eval_set}, {report.n} tasks: accuracy {report.accuracy:.1%} (greedy), avg@{k} "
            f"{report.avg_at_k:.1%}, pass@{k} {report.pass_at_k:.1%}")
    return result


def _register(cfg, run, source: str, accuracy: float, eval_set: str, label: str) -> dict:
    """The checkpoint's policy and critic as model versions (both point at the checkpoint, which holds both)."""
    tags = {"sao.checkpoint": label, "sao.algo": cfg.train.algo}
    policy = promote(run.client, f"{cfg.name}-{cfg.env.name}-policy", source, run.run_id, accuracy, eval_set, tags)
    from components.training.algorithms import ALGORITHMS

    if ALGORITHMS[cfg.train.algo].uses_critic:
        promote(run.client, f"{cfg.name}-{cfg.env.name}-critic", source, run.run_id, accuracy, eval_set, tags)
    return {"registered": f"{policy.name} v{policy.version}", "champion": policy.champion,
            "promoted": policy.promoted}

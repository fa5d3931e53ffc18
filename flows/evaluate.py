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

from components.stages import evaluate as stage
from flows.common import IO_RETRIES, NO_CACHE, context, markdown_table, tracked


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def load_tasks(cfg, benchmark: str, tasks: str) -> tuple[list | None, str]:
    """(tasks, eval set name): a benchmark file (I/O: retried), or None for the environment's held-out set."""
    return stage.eval_tasks(cfg, benchmark, tasks)


@task(cache_policy=NO_CACHE, **IO_RETRIES)
def model_to_score(cfg, home, model: str, checkpoint_step: int | None, log) -> tuple[Path, str | None, str]:
    """(HF directory, the URI to register or None, a name for reports)."""
    return stage.model_to_score(cfg, home, model, checkpoint_step, log)


@task(cache_policy=NO_CACHE)
def score(cfg, model_dir, home, name, samples, tasks, eval_set, log):
    return stage.run_eval(cfg, model_dir, home, name, samples, log, tasks=tasks, eval_set=eval_set)


@flow(name="evaluate")
def evaluate(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    model: str = "",
    checkpoint_step: int | None = None,
    benchmark: str = "",
    tasks: str = "",
    samples: int = 1,
    register_model: bool = True,
    parent_run_id: str | None = None,
) -> dict:
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
        metrics = {
            f"{prefix}/accuracy": report.accuracy,
            f"{prefix}/avg_at_{k}": report.avg_at_k,
            f"{prefix}/pass_at_{k}": report.pass_at_k,
        }
        run.log_metrics(metrics, step=checkpoint_step or 0)
        result = {
            "eval_set": eval_set,
            "n": report.n,
            "accuracy": report.accuracy,
            "samples": k,
            "avg_at_k": report.avg_at_k,
            "pass_at_k": report.pass_at_k,
            "model": str(model_dir),
            "report": str(ctx.home / "reports" / f"{name}.json"),
        }
        if register_model and source is not None and cfg.tracking.backend == "mlflow":
            policy = stage.register(cfg, run.client, run.run_id, source, report.accuracy, eval_set, label)
            result.update(
                {
                    "registered": f"{policy.name} v{policy.version}",
                    "champion": policy.champion,
                    "promoted": policy.promoted,
                }
            )
    create_markdown_artifact(key="evaluate", markdown=markdown_table([result]))
    ctx.log(
        f"eval: {eval_set}, {report.n} tasks: accuracy {report.accuracy:.1%} (greedy), avg@{k} "
        f"{report.avg_at_k:.1%}, pass@{k} {report.pass_at_k:.1%}"
    )
    return result

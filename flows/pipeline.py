"""`pipeline`: the whole lifecycle, each stage a subflow under one MLflow parent run.

    distill -> gate -> sft -> value_pretrain -> train (from the pretrained critic) -> evaluate (registry)

The order is `components.stages.pipeline.order` (the other ranks of a torchrun job follow the same one:
components/stages/ranks.py); value pretraining runs only for an algorithm with a critic. Every stage is skipped when
its output for the same inputs is already complete in the store, and training resumes from its newest checkpoint, so
re-running a failed or killed pipeline continues where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from components.stages import pipeline as stage
from flows.common import context, markdown_table
from flows.distill import distill
from flows.evaluate import evaluate
from flows.sft import sft
from flows.train import train
from flows.value_pretrain import value_pretrain

STAGES: dict[str, Callable[[dict, dict], object]] = {
    "distill": lambda run, done: distill(**run),
    "sft": lambda run, done: sft(**run),
    "value-pretrain": lambda run, done: value_pretrain(**run),
    "train": lambda run, done: train(**run, resume=True, evaluate=False),
    "evaluate": lambda run, done: evaluate(**run, checkpoint_step=done["train"]["checkpoint_step"]),
}
"""Each stage's subflow, called with the pipeline's parameters and the results of the stages before it."""


@flow(name="pipeline")
def pipeline(preset: str = "tiny-cpu", overrides: list[str] | None = None, home: str | None = None) -> dict:
    """Returns the headline numbers of every stage."""
    ctx = context(preset, overrides, home)
    parent = stage.parent_run(ctx.cfg, ctx.home)
    run = {"preset": preset, "overrides": list(overrides or []), "home": str(ctx.home), "parent_run_id": parent.run_id}
    failed = True
    try:
        done: dict[str, object] = {}
        for name in stage.order(ctx.cfg):
            done[name] = STAGES[name](run, done)
        trained = done["train"]
        stage.record_held_out(
            ctx.cfg,
            ctx.home,
            trained.get("run_id"),
            done["sft"]["accuracy"],
            done["evaluate"]["accuracy"],
            trained["version"],
        )
        summary = stage.summary(ctx.cfg, done)
        parent.log_metrics({f"pipeline/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))})
        failed = False
    finally:
        parent.close(failed)
    create_markdown_artifact(key="pipeline", markdown=markdown_table([summary]))
    return summary

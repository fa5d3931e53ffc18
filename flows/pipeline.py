"""`pipeline`: the whole lifecycle, each stage a subflow under one MLflow parent run.

    distill -> gate -> sft -> value_pretrain -> train (critic from value_pretrain) -> evaluate (registry)

Every stage is skipped when its output for the same inputs is already complete in the store, and training resumes
from its newest checkpoint, so re-running a failed or killed pipeline continues where it stopped.
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from components.stages import pipeline as stage
from flows.common import context, markdown_table
from flows.distill import distill
from flows.evaluate import evaluate
from flows.sft import sft
from flows.train import train
from flows.value_pretrain import value_pretrain


@flow(name="pipeline")
def pipeline(preset: str = "tiny-cpu", overrides: list[str] | None = None, home: str | None = None) -> dict:
    """Returns the headline numbers of every stage."""
    ctx = context(preset, overrides, home)
    params = {"preset": preset, "overrides": list(overrides or []), "home": str(ctx.home)}
    parent = stage.parent_run(ctx.cfg, ctx.home)
    failed = True
    try:
        dataset = distill(**params, parent_run_id=parent.run_id)
        policy = sft(**params, parent_run_id=parent.run_id)
        critic = value_pretrain(**params, parent_run_id=parent.run_id) if stage.uses_critic(ctx.cfg) else None
        warm = stage.starts_warm(ctx.cfg)
        trained = train(
            **params,
            critic_path=critic["critic_dir"] if warm else "",
            resume=True,
            evaluate=False,
            parent_run_id=parent.run_id,
        )
        scored = evaluate(**params, checkpoint_step=trained["checkpoint_step"], parent_run_id=parent.run_id)
        stage.record_held_out(
            ctx.cfg, ctx.home, trained.get("run_id"), policy["accuracy"], scored["accuracy"], trained["version"]
        )
        summary = stage.summary(dataset, policy, critic, warm, trained, scored)
        parent.log_metrics({f"pipeline/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))})
        failed = False
    finally:
        parent.close(failed)
    create_markdown_artifact(key="pipeline", markdown=markdown_table([summary]))
    return summary

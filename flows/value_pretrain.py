"""`value_pretrain`: the critic trained on rollouts of the SFT policy until its held-out explained variance stops
improving (components/stages/value_pretrain.py); `train` starts its critic from it. Skipped when a complete
critic with the same recipe is in the home or the store."""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components.stages import value_pretrain as stage
from components.stages.home import artifact_uri
from components.stages.recipes import critic_key
from flows.common import NO_CACHE, context, markdown_table, tracked


@task(cache_policy=NO_CACHE)
def sft_policy(cfg, home, log):
    return stage.sft_policy(cfg, home, log)


@task(cache_policy=NO_CACHE)
def pretrain(cfg, home, sft_dir, log):
    return stage.run_value_pretrain(cfg, home, sft_dir, log)


@flow(name="value_pretrain")
def value_pretrain(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    parent_run_id: str | None = None,
) -> dict:
    """Returns the critic's directory and URI, and its held-out explained variance cold and pretrained."""
    ctx = context(preset, overrides, home)
    cfg = ctx.cfg
    with tracked(ctx, "value_pretrain", parent_run_id) as run:
        sft_dir = sft_policy(cfg, ctx.home, ctx.log)
        critic_dir, summary = pretrain(cfg, ctx.home, sft_dir, ctx.log)
        history = summary["ev_history"]
        for epoch, ev in enumerate(history):
            run.log_metrics({"value_pretrain/explained_variance": ev}, step=epoch)
        run.log_metrics(
            {
                "value_pretrain/ev_cold": summary["ev_cold"],
                "value_pretrain/ev_best": summary["ev_best"],
                "value_pretrain/best_epoch": summary["best_epoch"],
            }
        )
    uri = artifact_uri(cfg.store, ctx.home, critic_key(cfg, sft_dir))
    create_markdown_artifact(
        key="value-pretrain",
        markdown=markdown_table(
            [
                {
                    "critic": uri,
                    "held-out EV cold": summary["ev_cold"],
                    "held-out EV pretrained": summary["ev_best"],
                    "best epoch": summary["best_epoch"],
                    "epochs": len(history) - 1,
                }
            ]
        ),
    )
    return {"critic_dir": str(critic_dir), "uri": uri, "ev_cold": summary["ev_cold"], "ev_best": summary["ev_best"]}

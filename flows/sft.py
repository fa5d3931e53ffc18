"""`sft`: supervised fine-tuning on the distilled dataset, then the policy's held-out accuracy.

Skipped (reused) when a complete SFT policy with the same recipe is in the home or the store; it distils first
(through the gate) when the dataset does not exist yet.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from components.stages import sft as stage
from components.stages.home import artifact_uri
from components.stages.recipes import sft_key
from flows.common import NO_CACHE, context, markdown_table, tracked


@task(cache_policy=NO_CACHE)
def train_policy(cfg, home, force: bool, log):
    return stage.run_sft(cfg, home, force=force, log=log)


@task(cache_policy=NO_CACHE)
def held_out_accuracy(cfg, sft_dir, home, log) -> float:
    return stage.sft_eval(cfg, sft_dir, home, log)


@flow(name="sft")
def sft(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    force: bool = False,
    parent_run_id: str | None = None,
) -> dict:
    """Returns the SFT policy's directory, URI and held-out accuracy."""
    ctx = context(preset, overrides, home)
    cfg = ctx.cfg
    with tracked(ctx, "sft", parent_run_id) as run:
        sft_dir = train_policy(cfg, ctx.home, force, ctx.log)
        accuracy = held_out_accuracy(cfg, sft_dir, ctx.home, ctx.log)
        run.log_metrics({f"eval/{cfg.env.name}/accuracy": accuracy})
    uri = artifact_uri(cfg.store, ctx.home, sft_key(cfg))
    create_markdown_artifact(key="sft", markdown=markdown_table([{"policy": uri, "held-out accuracy": accuracy}]))
    return {"model_dir": str(sft_dir), "uri": uri, "accuracy": accuracy}

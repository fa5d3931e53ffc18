"""`train`: the long-running asynchronous SAO run (or a baseline: `train.algo`).

Checkpoints go to the store every `train.checkpoint_every` steps; each complete one emits the Prefect event
`sao.checkpoint.saved` (payload: step, uri, preset, env, algo, and the run's overrides and home, so that the
`evaluate/on-checkpoint-*` deployments' triggers in infra/prefect.yaml score that very checkpoint).
Re-running with `resume=True` continues from the newest complete checkpoint. The critic RL starts from is found by
the one rule every entry point shares (`train.critic_path`, else the pretrained critic when
`value_pretrain.warm_start`: components/stages/value_pretrain.py `starting_critic`).
"""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from components.config import Config
from components.stages import train as stage
from flows.common import context, markdown_table

CHECKPOINT_EVENT = "sao.checkpoint.saved"


def checkpoint_event(cfg: Config, step: int, uri: str, overrides: list[str] | None = None, home: str = "") -> dict:
    """The event's fields: the checkpoint as the resource, the training run as a related resource; the payload
    carries what an `evaluate` run needs to rebuild this config and find the checkpoint."""
    return {
        "event": CHECKPOINT_EVENT,
        "resource": {
            "prefect.resource.id": f"sao.checkpoint.{cfg.name}.{cfg.env.name}.{step}",
            "prefect.resource.name": uri,
        },
        "related": [
            {"prefect.resource.id": f"sao.training.{cfg.name}.{cfg.env.name}", "prefect.resource.role": "training-run"}
        ],
        "payload": {
            "step": step,
            "uri": uri,
            "preset": cfg.name,
            "env": cfg.env.name,
            "algo": cfg.train.algo,
            "overrides": list(overrides or []),
            "home": home,
        },
    }


@flow(name="train")
def train(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    home: str | None = None,
    resume: bool = False,
    evaluate: bool = True,
    parent_run_id: str | None = None,
) -> dict:
    """Returns the final version, the policy's directory, the newest checkpoint step and throughput."""
    ctx = context(preset, overrides, home)
    cfg = ctx.cfg

    def on_checkpoint(step: int, uri: str) -> None:
        emit_event(**checkpoint_event(cfg, step, uri, overrides, str(ctx.home.resolve())))

    result = stage.run_train(
        cfg,
        ctx.home,
        resume=resume,
        log=ctx.log,
        parent_run_id=parent_run_id,
        on_checkpoint=on_checkpoint,
        evaluate=evaluate,
    )
    result["checkpoint_step"] = stage.latest_checkpoint(cfg, ctx.home)
    result["policy_dir"] = str(result.get("policy_dir", ""))
    create_markdown_artifact(
        key="train",
        markdown=markdown_table(
            [
                {
                    k: result.get(k)
                    for k in ("version", "before", "after", "rollbacks", "checkpoint_step", "trajectories_per_s")
                }
            ]
        ),
    )
    return result

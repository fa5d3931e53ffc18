"""The pipeline's own parts: its order of stages (read by the flow and by the other ranks of a torchrun job), its key
(a retried pipeline continues under one MLflow parent run), and the headline numbers of all stages."""

from __future__ import annotations

from pathlib import Path

from components.config import Config, to_dict
from components.stages.recipes import fingerprint
from components.stages.value_pretrain import starts_warm, uses_critic
from components.tracking.stage_runs import pipeline_run, reopen


def parent_run(cfg: Config, home: Path):
    """The pipeline's MLflow parent run, found again for the same config and home (a retried flow run)."""
    return pipeline_run(cfg, home, fingerprint({"config": to_dict(cfg), "home": str(home)}))


def record_held_out(
    cfg: Config, home: Path, training_run_id: str | None, before: float, after: float, version: int
) -> None:
    """The held-out accuracy before RL (step 0) and after it (the final version) in the training run itself, as
    `sao train` logs them: `sao report` and `sao compare` then show what the run achieved, not only its reward."""
    run = reopen(cfg, home, training_run_id)
    key = f"eval/{cfg.env.name}/accuracy"
    run.log_metrics({key: before}, 0)
    run.log_metrics({key: after}, version)
    run.close()


def order(cfg: Config) -> tuple[str, ...]:
    """The pipeline's stages in order (the flows' names as the CLI spells them): the value-pretraining stage only
    when the algorithm has a critic. `train` finds the critic the stage before it pretrained (`starting_critic`) and
    `evaluate` scores the newest checkpoint."""
    return ("distill", "sft", *(("value-pretrain",) if uses_critic(cfg) else ()), "train", "evaluate")


def summary(cfg: Config, results: dict[str, object]) -> dict:
    """The headline numbers of every stage, from the stage flows' results (keyed by `order`'s names)."""
    policy, trained, scored = results["sft"], results["train"], results["evaluate"]
    critic = results.get("value-pretrain")
    return {
        "dataset": results["distill"],
        "sft_policy": policy["uri"],
        "sft_accuracy": policy["accuracy"],
        "critic": critic["uri"] if critic else None,
        "critic_ev_cold": critic["ev_cold"] if critic else None,
        "critic_ev_pretrained": critic["ev_best"] if critic else None,
        "critic_warm_start": starts_warm(cfg),
        "ev_step1": trained.get("explained_variance_step1"),
        "version": trained["version"],
        "rollbacks": trained["rollbacks"],
        "trajectories_per_s": trained["trajectories_per_s"],
        "trainer_idle": trained["idle_frac"],
        "accuracy": scored["accuracy"],
        "eval_set": scored["eval_set"],
        "registered": scored.get("registered"),
        "champion": scored.get("champion"),
    }

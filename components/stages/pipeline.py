"""The pipeline's own parts: its key (a retried pipeline continues under one MLflow parent run), whether the
configured algorithm needs the value-pretraining stage, and the headline numbers of all stages."""

from __future__ import annotations

from pathlib import Path

from components.config import Config, to_dict
from components.stages.recipes import fingerprint
from components.tracking.stage_runs import pipeline_run, reopen
from components.training.rl.algorithms import ALGORITHMS


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


def uses_critic(cfg: Config) -> bool:
    return ALGORITHMS[cfg.train.algo].uses_critic


def starts_warm(cfg: Config) -> bool:
    """RL starts its critic from the pretrained one (`value_pretrain.warm_start`), in the pipeline and `sao sweep`."""
    return uses_critic(cfg) and cfg.value_pretrain.warm_start


def summary(dataset: str, policy: dict, critic: dict | None, warm: bool, trained: dict, scored: dict) -> dict:
    """The headline numbers of every stage, from the stage flows' results."""
    return {
        "dataset": dataset,
        "sft_policy": policy["uri"],
        "sft_accuracy": policy["accuracy"],
        "critic": critic["uri"] if critic else None,
        "critic_ev_cold": critic["ev_cold"] if critic else None,
        "critic_ev_pretrained": critic["ev_best"] if critic else None,
        "critic_warm_start": warm,
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

"""What each stage's output depends on (its recipe), and the key it is stored under.

A stage reuses a complete artifact only when the recipe saved beside it equals the one computed here from the
config (components/stages/home.py fetches and publishes them). Recipes are JSON-normalised (a round trip turns
tuples into lists), so they compare equal to a saved copy.

    data/sft-<env>-<fingerprint(data_recipe)>/            the gated SFT dataset
    models/sft-<env>/ (+ sao_sft.json: sft_recipe)        the SFT policy
    models/critic-<env>-<fingerprint(critic_recipe)>/     the pretrained critic
    reports/sft-eval.json (eval_task)                     the SFT policy's held-out accuracy
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from components.config import Config, to_dict
from components.storage import weights_fingerprint
from components.training.engines.settings import critic_grad_clip
from components.training.rl.algorithms import ALGORITHMS

SFT_TASK_FIELDS = ("kinds", "operand_max", "train_size", "seed", "teacher_mental_max", "teacher_mental_frac")
"""The task fields that shape the SFT problems (the eval set size or turn limits do not)."""
_RECIPE_DEFAULTS = {"teacher_mental_frac": 1.0}
"""Fields added after datasets were stored: left out of a recipe at their default, so its key stays the same."""
EVAL_TASK_FIELDS = ("kinds", "operand_max", "eval_size", "seed", "max_turns", "max_new_tokens")
"""The task fields that shape the held-out episodes."""
PROMPT_SEED_SHIFT = 10_000
"""Value pretraining rolls out the training stream of `train.task_seed + PROMPT_SEED_SHIFT` (far from the
small seeds sweeps use, so no RL run of a neighbouring seed sees the same prompts first)."""


def fingerprint(data: dict) -> str:
    """Short sha256 of JSON data (keys sorted): names what a config produced."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def _normalised(recipe: dict) -> dict:
    return json.loads(json.dumps(recipe))


def data_recipe(cfg: Config) -> dict:
    """What the SFT dataset depends on: the environment, the task fields of the training problems, and the
    teacher when it is an endpoint."""
    task = {
        k: v
        for k, v in to_dict(cfg.task).items()
        if k in SFT_TASK_FIELDS and (k not in _RECIPE_DEFAULTS or v != _RECIPE_DEFAULTS[k])
    }
    env: dict = {"name": cfg.env.name, "tasks": cfg.env.tasks}
    if cfg.env.entrypoint:  # a factory's datasets depend on it and its options; built-ins keep their keys
        env.update(entrypoint=cfg.env.entrypoint, options=cfg.env.options)
    recipe: dict = {"env": env, "task": task}
    if cfg.distill.teacher != "programmatic":  # the embedded default keeps the keys it always had
        d = cfg.distill
        recipe["teacher"] = {
            "url": d.teacher,
            "model": d.model,
            "temperature": d.temperature,
            "max_tokens": d.max_tokens,
            "max_turns": d.max_turns,
        }
    return _normalised(recipe)


def dataset_key(cfg: Config) -> str:
    return f"data/sft-{cfg.env.name}-{fingerprint(data_recipe(cfg))}"


def sft_recipe(cfg: Config) -> dict:
    """What an SFT policy depends on: its dataset's recipe, the model and the SFT settings."""
    return _normalised({"model": to_dict(cfg.model), **data_recipe(cfg), "sft": to_dict(cfg.sft)})


def sft_key(cfg: Config) -> str:
    return f"models/sft-{cfg.env.name}"


def eval_task(cfg: Config) -> dict:
    """What decides the held-out episodes: the environment and the task fields that shape them."""
    task = {k: v for k, v in to_dict(cfg.task).items() if k in EVAL_TASK_FIELDS}
    return _normalised({"env": to_dict(cfg.env), "task": task})


def prompt_config(cfg: Config) -> Config:
    """The config whose training stream value pretraining rolls out: `train.task_seed` shifted by
    `PROMPT_SEED_SHIFT`."""
    return replace(cfg, train=replace(cfg.train, task_seed=cfg.train.task_seed + PROMPT_SEED_SHIFT))


def value_pretrain_recipe(cfg: Config, sft_dir: Path) -> dict:
    """What a pretrained critic depends on: the SFT weights, the rollouts' settings and the critic's training
    settings (not `value_pretrain.warm_start`, which decides only whether RL uses it)."""
    tc = cfg.train
    training = {
        "freeze_attention": ALGORITHMS[tc.algo].freeze_critic_attention,
        "lr": cfg.value_pretrain.lr or tc.critic_lr,
        "weight_decay": tc.weight_decay,
        "grad_clip": critic_grad_clip(tc),  # the same keys (and hash) as before critic_grad_clip existed
        "adam_beta2": tc.adam_beta2,
        "task_seed": prompt_config(cfg).train.task_seed,
    }
    algo = {k: getattr(cfg.algo, k) for k in ("gamma", "lam_critic", "value_clip", "temperature")}
    rollout = {k: getattr(cfg.rollout, k) for k in ("max_total_tokens", "max_wall_s", "tool_timeout_s")}
    value_pretrain = {k: v for k, v in to_dict(cfg.value_pretrain).items() if k != "warm_start"}
    return _normalised(
        {
            "model": to_dict(cfg.model),
            "env": to_dict(cfg.env),
            "task": to_dict(cfg.task),
            "value_pretrain": value_pretrain,
            "algo": algo,
            "rollout": rollout,
            "training": training,
            "sft_weights": weights_fingerprint(sft_dir),
        }
    )


def critic_key(cfg: Config, sft_dir: Path) -> str:
    return f"models/critic-{cfg.env.name}-{fingerprint(value_pretrain_recipe(cfg, sft_dir))}"

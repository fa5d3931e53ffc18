"""The value-pretraining stage: the critic trained on rollouts of the SFT policy before RL, kept under a key named
by its recipe and reused when the recipe matches.

    SFT policy --rollouts--> split by prompt --> fit_critic (components/training/value_pretrain.py)
               --> models/critic-<env>-<hash>/  ValueModel.save (backbone + value_head.safetensors), value_pretrain.json

The critic starts as training would start it (`ValueModel.from_policy`, attention frozen when `train.algo`
freezes it) and learns with training's loss and optimizer settings (`train.weight_decay`, `grad_clip`,
`adam_beta2`; `value_pretrain.lr`, else `train.critic_lr`). Prompts come from the environment's training stream
with `train.task_seed + PROMPT_SEED_SHIFT`, so the critic is not pretrained on RL's own first prompts. The
built-in coding and style sets are small and cycled: there the shifted seed only reorders them and the same
tasks recur.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from components.config import Config
from components.contracts.trajectory import Trajectory
from components.envs.registry import build_env
from components.models import ValueModel, freeze_attention, load_policy, load_tokenizer
from components.stages.home import Log, available, publish
from components.stages.recipes import critic_key, prompt_config, value_pretrain_recipe
from components.stages.rollout import sample_episodes
from components.stages.sft import run_sft
from components.storage import atomic_dir, write_json
from components.training.algorithms import ALGORITHMS
from components.training.engines import TorchEngine
from components.training.value_pretrain import FitSettings, fit_critic, split_by_prompt

SUMMARY_FILE = "value_pretrain.json"
"""Written into the critic's directory: the recipe and the numbers of the run."""


@dataclass
class ValuePretrainResult:
    ev_cold: float
    """Held-out explained variance of the cold critic (fresh head), before any update."""
    ev_history: list[float]
    """Held-out explained variance per epoch; index 0 is the cold critic, index e is after epoch e."""
    best_epoch: int
    """The epoch whose weights were saved (0: no epoch beat the cold critic)."""
    ev_best: float
    """Held-out explained variance of the saved critic."""
    episodes: int
    """Rollouts collected (training and held-out parts)."""
    held_out: int
    """Of which held out."""
    seconds: float
    """Wall time, rollouts included."""
    out_dir: Path
    """The saved critic's directory (`ValueModel.load` reads it)."""


def sft_policy(cfg: Config, home: Path, log: Log = print) -> Path:
    """The SFT policy the critic learns the values of (trained first when the home and the store lack it)."""
    return run_sft(cfg, home, log=log)


def run_value_pretrain(cfg: Config, home: Path, sft_dir: Path, log: Log = print) -> tuple[Path, dict]:
    """(critic directory, its summary): the complete critic pretrained from these inputs, or a new one."""
    key = critic_key(cfg, sft_dir)
    out = Path(home) / key
    if available(cfg, home, key, log):
        log(f"value_pretrain: reusing the complete critic at {out}")
        publish(cfg, home, key, log, again=False)
        return out, json.loads((out / SUMMARY_FILE).read_text())["result"]
    pretrain_value(cfg, sft_dir, out, log)
    publish(cfg, home, key, log)
    return out, json.loads((out / SUMMARY_FILE).read_text())["result"]


def pretrain_value(cfg: Config, sft_dir: Path, out_dir: Path, log: Log = print) -> ValuePretrainResult:
    """Roll out the SFT policy at `sft_dir`, pretrain a critic on the rollouts (`cfg.value_pretrain`) and save
    the best epoch's critic to `out_dir` (written atomically, with `value_pretrain.json` inside)."""
    algorithm = ALGORITHMS[cfg.train.algo]
    if not algorithm.uses_critic:
        users = sorted(name for name, a in ALGORITHMS.items() if a.uses_critic)
        raise ValueError(f"train.algo: {cfg.train.algo!r} trains no critic; value pretraining is for {users}")
    vp, tc = cfg.value_pretrain, cfg.train
    start = time.perf_counter()
    train_part, held_out = collect_rollouts(cfg, sft_dir, log)

    torch.manual_seed(vp.seed)  # the fresh value head
    critic = ValueModel.from_policy(load_policy(sft_dir))
    if algorithm.freeze_critic_attention:
        freeze_attention(critic)
    engine = TorchEngine(
        critic, vp.lr or tc.critic_lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip, beta2=tc.adam_beta2
    )
    settings = FitSettings(
        cfg.algo.gamma, cfg.algo.lam_critic, cfg.algo.value_clip, vp.batch_size, vp.max_epochs, vp.patience, vp.seed
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads or threads)  # train.threads = 0: every core (nothing else runs now)
    try:
        history, best_epoch = fit_critic(
            engine, train_part, held_out, load_tokenizer(sft_dir).pad_token_id, settings, log
        )
    finally:
        torch.set_num_threads(threads)

    result = ValuePretrainResult(
        history[0],
        history,
        best_epoch,
        history[best_epoch],
        len(train_part) + len(held_out),
        len(held_out),
        time.perf_counter() - start,
        Path(out_dir),
    )
    summary = {k: v for k, v in asdict(result).items() if k != "out_dir"}
    with atomic_dir(out_dir) as tmp:
        critic.save(tmp)
        write_json(tmp / SUMMARY_FILE, {"recipe": value_pretrain_recipe(cfg, sft_dir), "result": summary})
    log(
        f"value-pretrain: kept epoch {best_epoch} (held-out EV {result.ev_cold:.3f} -> {result.ev_best:.3f}), "
        f"{result.seconds:.1f}s; saved {out_dir}"
    )
    return result


def collect_rollouts(cfg: Config, sft_dir: Path, log: Log = print) -> tuple[list[Trajectory], list[Trajectory]]:
    """`value_pretrain.episodes` episodes of the SFT policy on the shifted prompt stream (`prompt_config`),
    split by prompt into (training part, held-out part)."""
    vp = cfg.value_pretrain
    setup = build_env(prompt_config(cfg), log)
    tasks = list(itertools.islice(setup.train_tasks(0, 1), vp.episodes))
    # As many in flight as the engine batches (as evaluation does): nothing trains while they run.
    trajectories, seconds = sample_episodes(cfg, sft_dir, setup.env, tasks, vp.seed, cfg.rollout.max_batch)
    train_part, held_out = split_by_prompt(trajectories, vp.held_out_episodes, vp.seed)
    reward = sum(t.reward for t in trajectories) / len(trajectories)
    log(
        f"value-pretrain: {len(trajectories)} {setup.name} episodes in {seconds:.1f}s (reward mean {reward:.3f}); "
        f"{len(train_part)} train / {len(held_out)} held-out prompts"
    )
    return train_part, held_out

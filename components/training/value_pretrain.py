"""Value-model pretraining (DESIGN section 2, "Value pretraining"; SAO paper: value pretraining against the
critic's cold start).

    SFT policy --rollouts--> split by prompt --> critic epochs of minibatches --> held-out EV per epoch
               --> early stop --> best epoch's weights saved (`ValueModel.save`), for `train.critic_path`

The critic starts as training would start it (`ValueModel.from_policy`, attention frozen when `train.algo`
freezes it) and learns with training's loss: skip-observation GAE targets with `algo.gamma` and
`algo.lam_critic`, the clipped value loss with `algo.value_clip`, AdamW through the torch engine. After every
epoch the explained variance on the held-out prompts (the function behind `critic/explained_variance`, over
action tokens) decides early stopping; epoch 0 is the cold critic.

Choices the paper leaves open:
- Prompts come from the environment's training stream with `train.task_seed + PROMPT_SEED_SHIFT`, so the critic
  is not pretrained on RL's own first prompts. The built-in coding and style sets are small and cycled: there
  the shifted seed only reorders them and the same tasks recur.
- The "old values" of the clipped loss, and for lam_critic < 1 the values the targets bootstrap from, are the
  critic's values at the start of each epoch, as PPO scores a batch once before its epochs. With lam_critic = 1
  the targets are the Monte-Carlo returns and never change.
- For lam_critic < 1 the held-out targets bootstrap from the values being evaluated, as training's metric does.
- One process and plain torch AdamW (`train.weight_decay`, `grad_clip`, `adam_beta2`): pretraining is small
  next to RL and needs no DeepSpeed ranks.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from components.agent.rollout_job import sample_episodes
from components.algo import clipped_value_loss, explained_variance, gae
from components.config import Config, to_dict
from components.contracts.trajectory import TrainBatch, Trajectory, to_tensors
from components.envs.registry import build_env
from components.models import ValueModel, freeze_attention, load_policy, load_tokenizer
from components.storage import atomic_dir, weights_fingerprint, write_json
from components.training.algorithms import ALGORITHMS
from components.training.engines import TorchEngine

PROMPT_SEED_SHIFT = 10_000
"""Value pretraining rolls out the training stream of `train.task_seed + PROMPT_SEED_SHIFT` (far from the
small seeds sweeps use, so no RL run of a neighbouring seed sees the same prompts first)."""
SUMMARY_FILE = "value_pretrain.json"
"""Written into the critic's directory: the recipe and the numbers of the run."""

Log = Callable[[str], None]


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


@dataclass(frozen=True)
class FitSettings:
    """The numbers the epochs need (resolved from the config once)."""

    gamma: float
    lam: float
    value_clip: float
    batch_size: int
    max_epochs: int
    patience: int
    seed: int


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
    engine = TorchEngine(critic, vp.lr or tc.critic_lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip,
                         beta2=tc.adam_beta2)
    settings = FitSettings(cfg.algo.gamma, cfg.algo.lam_critic, cfg.algo.value_clip, vp.batch_size, vp.max_epochs,
                           vp.patience, vp.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads or threads)  # train.threads = 0: every core (nothing else runs now)
    try:
        history, best_epoch = fit_critic(engine, train_part, held_out, load_tokenizer(sft_dir).pad_token_id,
                                         settings, log)
    finally:
        torch.set_num_threads(threads)

    result = ValuePretrainResult(history[0], history, best_epoch, history[best_epoch],
                                 len(train_part) + len(held_out), len(held_out), time.perf_counter() - start,
                                 Path(out_dir))
    summary = {k: v for k, v in asdict(result).items() if k != "out_dir"}
    with atomic_dir(out_dir) as tmp:
        critic.save(tmp)
        write_json(tmp / SUMMARY_FILE, {"recipe": value_pretrain_recipe(cfg, sft_dir), "result": summary})
    log(f"value-pretrain: kept epoch {best_epoch} (held-out EV {result.ev_cold:.3f} -> {result.ev_best:.3f}), "
        f"{result.seconds:.1f}s; saved {out_dir}")
    return result


def collect_rollouts(cfg: Config, sft_dir: Path, log: Log = print) -> tuple[list[Trajectory], list[Trajectory]]:
    """`value_pretrain.episodes` episodes of the SFT policy on the shifted prompt stream (`prompt_config`),
    split by prompt into (training part, held-out part)."""
    vp = cfg.value_pretrain
    setup = build_env(prompt_config(cfg))
    tasks = list(itertools.islice(setup.train_tasks(0, 1), vp.episodes))
    # As many in flight as the engine batches (as evaluation does): nothing trains while they run.
    trajectories, seconds = sample_episodes(cfg, sft_dir, setup.env, tasks, vp.seed, cfg.rollout.max_batch)
    train_part, held_out = split_by_prompt(trajectories, vp.held_out_episodes, vp.seed)
    reward = sum(t.reward for t in trajectories) / len(trajectories)
    log(f"value-pretrain: {len(trajectories)} {setup.name} episodes in {seconds:.1f}s (reward mean {reward:.3f}); "
        f"{len(train_part)} train / {len(held_out)} held-out prompts")
    return train_part, held_out


def value_pretrain_recipe(cfg: Config, sft_dir: Path) -> dict:
    """What a pretrained critic depends on; a caller reuses a saved critic only when the recipe in its
    `value_pretrain.json` equals this."""
    tc = cfg.train
    training = {"freeze_attention": ALGORITHMS[tc.algo].freeze_critic_attention,
                "lr": cfg.value_pretrain.lr or tc.critic_lr, "weight_decay": tc.weight_decay,
                "grad_clip": tc.grad_clip, "adam_beta2": tc.adam_beta2,
                "task_seed": prompt_config(cfg).train.task_seed}
    algo = {k: getattr(cfg.algo, k) for k in ("gamma", "lam_critic", "value_clip", "temperature")}
    rollout = {k: getattr(cfg.rollout, k) for k in ("max_total_tokens", "max_wall_s", "tool_timeout_s")}
    recipe = {"model": to_dict(cfg.model), "env": to_dict(cfg.env), "task": to_dict(cfg.task),
              "value_pretrain": {k: v for k, v in to_dict(cfg.value_pretrain).items() if k != "warm_start"}, "algo": algo, "rollout": rollout,
              "training": training, "sft_weights": weights_fingerprint(sft_dir)}
    # JSON round trip so that it compares equal to the copy saved next to the weights (tuples become lists).
    return json.loads(json.dumps(recipe))


def prompt_config(cfg: Config) -> Config:
    """The config whose training stream value pretraining rolls out: `train.task_seed` shifted by
    `PROMPT_SEED_SHIFT`."""
    return replace(cfg, train=replace(cfg.train, task_seed=cfg.train.task_seed + PROMPT_SEED_SHIFT))


def split_by_prompt(trajectories: list[Trajectory], held_out: int, seed: int
                    ) -> tuple[list[Trajectory], list[Trajectory]]:
    """(training part, held-out part): `held_out` prompts drawn by `seed`, every trajectory of a prompt on the
    same side. Both parts are sorted by prompt id, so the split does not depend on finish order."""
    prompts = sorted({t.prompt_id for t in trajectories})
    if not 1 <= held_out < len(prompts):
        raise ValueError(f"held_out: need 1 <= held_out < {len(prompts)} prompts, got {held_out}")
    random.Random(seed).shuffle(prompts)
    chosen = set(prompts[:held_out])
    ordered = sorted(trajectories, key=lambda t: t.prompt_id)
    return [t for t in ordered if t.prompt_id not in chosen], [t for t in ordered if t.prompt_id in chosen]


def value_targets(batch: TrainBatch, values: Tensor, gamma: float, lam: float) -> Tensor:
    """Critic targets `R_t = A_t + V(s_t)` of skip-observation GAE (training's `critic_updates` uses the same).

    Args:
        batch: `to_tensors` output; `rewards` and `action_mask` are read.
        values: `(B, T)` the critic's values the targets bootstrap from; with lam = 1 they cancel and the
            targets are the discounted Monte-Carlo returns.
    Returns:
        `(B, T)` targets, 0 off action tokens.
    """
    return gae(batch["rewards"], values, batch["action_mask"], gamma, lam)[1]


def fit_critic(engine: TorchEngine, train: list[Trajectory], held_out: list[Trajectory], pad_id: int,
               s: FitSettings, log: Log = print) -> tuple[list[float], int]:
    """Epochs of minibatch updates until the held-out explained variance has not improved for `s.patience`
    epochs (or `s.max_epochs`); the critic (`engine.module`) ends with the best epoch's weights.

    Returns (held-out EV per epoch, index 0 the critic as it came in; the best epoch)."""
    critic = engine.module
    held_batches = _batches(held_out, s.batch_size, pad_id)
    history = [held_out_ev(critic, held_batches, s.gamma, s.lam)]
    log(f"value-pretrain: epoch 0 (cold critic) held-out EV {history[0]:.3f}")
    best_epoch, best = 0, _trainable_snapshot(critic)
    order = list(train)
    rng = random.Random(s.seed)
    for epoch in range(1, s.max_epochs + 1):
        rng.shuffle(order)
        loss = _epoch(engine, _batches(order, s.batch_size, pad_id), s)
        history.append(held_out_ev(critic, held_batches, s.gamma, s.lam))
        if history[epoch] > history[best_epoch]:
            best_epoch, best = epoch, _trainable_snapshot(critic)
        log(f"value-pretrain: epoch {epoch}/{s.max_epochs} loss {loss:.4f} held-out EV {history[epoch]:.3f} "
            f"(best {history[best_epoch]:.3f} at epoch {best_epoch})")
        if epoch - best_epoch >= s.patience:
            break
    _restore(critic, best)
    return history, best_epoch


def held_out_ev(critic: ValueModel, batches: list[TrainBatch], gamma: float, lam: float) -> float:
    """`explained_variance` of the critic's values against their targets over every action token of
    `batches` together (not a mean of per-batch EVs)."""
    values, targets = [], []
    with torch.no_grad():
        for batch in batches:
            v = critic(batch["input_ids"], batch["attention_mask"])
            acting = batch["action_mask"].bool()
            values.append(v[acting])
            targets.append(value_targets(batch, v, gamma, lam)[acting])
    v, r = torch.cat(values)[None], torch.cat(targets)[None]
    return float(explained_variance(v, r, torch.ones_like(v)))


def _epoch(engine: TorchEngine, batches: list[TrainBatch], s: FitSettings) -> float:
    """One pass: score every minibatch with the critic as the epoch starts (old values, targets), then one
    update per minibatch on the clipped value loss. Returns the mean loss."""
    critic = engine.module
    with torch.no_grad():
        old = [critic(b["input_ids"], b["attention_mask"]) for b in batches]
    losses = []
    for batch, old_values in zip(batches, old):
        targets = value_targets(batch, old_values, s.gamma, s.lam)
        values = critic(batch["input_ids"], batch["attention_mask"])
        loss, metrics = clipped_value_loss(values, old_values, targets, batch["action_mask"], s.value_clip)
        engine.backward_step(loss)
        losses.append(float(metrics["critic/loss"]))
    return sum(losses) / len(losses)


def _batches(trajectories: list[Trajectory], size: int, pad_id: int) -> list[TrainBatch]:
    return [to_tensors(trajectories[i:i + size], pad_id) for i in range(0, len(trajectories), size)]


def _trainable_snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    """Copies of the trainable parameters (the frozen ones never change)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _restore(model: torch.nn.Module, snapshot: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in snapshot:
                param.copy_(snapshot[name])

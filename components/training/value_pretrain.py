"""The critic's pretraining on a fixed set of rollouts (docs/design.md, value pretraining; SAO paper: value
pretraining against the critic's cold start). Which rollouts, and where the critic is saved, is the stage's
business (components/stages/value_pretrain.py); this module is the fitting.

    rollouts split by prompt --> critic epochs of minibatches --> held-out EV per epoch --> early stop
             --> the best epoch's weights

The critic learns with training's loss: skip-observation GAE targets with `gamma` and `lam`, the clipped value
loss with `value_clip`, through a `TorchEngine`. After every epoch the explained variance on the held-out prompts
(the function behind `critic/explained_variance`, over action tokens) decides early stopping; epoch 0 is the
critic as it came in.

Choices the paper leaves open:
- The "old values" of the clipped loss, and for lam < 1 the values the targets bootstrap from, are the critic's
  values at the start of each epoch, as PPO scores a batch once before its epochs. With lam = 1 the targets are
  the Monte-Carlo returns and never change.
- For lam < 1 the held-out targets bootstrap from the values being evaluated, as training's metric does.
- One process and plain torch AdamW: pretraining is small next to RL and needs no DeepSpeed ranks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from components.algo import clipped_value_loss, explained_variance, gae
from components.contracts.trajectory import TrainBatch, Trajectory, to_tensors
from components.models import ValueModel
from components.training.engines import TorchEngine

Log = Callable[[str], None]


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


def split_by_prompt(
    trajectories: list[Trajectory], held_out: int, seed: int
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


def fit_critic(
    engine: TorchEngine,
    train: list[Trajectory],
    held_out: list[Trajectory],
    pad_id: int,
    s: FitSettings,
    log: Log = print,
) -> tuple[list[float], int]:
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
        log(
            f"value-pretrain: epoch {epoch}/{s.max_epochs} loss {loss:.4f} held-out EV {history[epoch]:.3f} "
            f"(best {history[best_epoch]:.3f} at epoch {best_epoch})"
        )
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
    return [to_tensors(trajectories[i : i + size], pad_id) for i in range(0, len(trajectories), size)]


def _trainable_snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    """Copies of the trainable parameters (the frozen ones never change)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _restore(model: torch.nn.Module, snapshot: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in snapshot:
                param.copy_(snapshot[name])

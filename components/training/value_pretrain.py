"""The critic's pretraining on a fixed set of rollouts (docs/design.md, value pretraining; SAO paper: value
pretraining against the critic's cold start). Which rollouts, and where the critic is saved, is the stage's
business (components/stages/value_pretrain.py); this module is the fitting.

    rollouts split by prompt --> critic epochs of minibatches --> held-out EV per epoch --> early stop
             --> the best epoch's weights

The critic learns with training's loss: skip-observation GAE targets with `gamma` and `lam`, the clipped value
loss with `value_clip`, through a training engine. After every epoch the explained variance on the held-out prompts
(the function behind `critic/explained_variance`, over action tokens) decides early stopping; epoch 0 is the
critic as it came in.

Choices the paper leaves open:
- The "old values" of the clipped loss, and for lam < 1 the values the targets bootstrap from, are the critic's
  values at the start of each epoch, as PPO scores a batch once before its epochs. With lam = 1 the targets are
  the Monte-Carlo returns and never change.
- For lam < 1 the held-out targets bootstrap from the values being evaluated, as training's metric does.
- It runs on a training engine: plain torch in one process, or DeepSpeed on every rank under torchrun
  (`value_pretrain.backend`), each rank on its rows of every minibatch, in micro-batches (micro.py), as RL's
  critic updates do. The best epoch is kept as the engine's own checkpoint files, so ZeRO-3's partitions too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from components.algo import clipped_value_loss, explained_variance, gae
from components.config import Config
from components.contracts.trajectory import TrainBatch, Trajectory, to_tensors
from components.models import ValueModel
from components.training.engines.collective import SOLO, Collective
from components.training.engines.micro import MicroBatches, TokenWeighted, rank_share

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
    micro_batch_tokens: int = 0
    """Padded tokens per forward/backward pass on each rank (`train.micro_batch_tokens`; 0: one pass)."""

    @classmethod
    def from_config(cls, cfg: Config) -> FitSettings:
        """`value_pretrain`'s epochs on RL's critic targets (`algo.gamma`, `algo.lam_critic`, `algo.value_clip`)."""
        vp = cfg.value_pretrain
        return cls(
            gamma=cfg.algo.gamma,
            lam=cfg.algo.lam_critic,
            value_clip=cfg.algo.value_clip,
            batch_size=vp.batch_size,
            max_epochs=vp.max_epochs,
            patience=vp.patience,
            seed=vp.seed,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
        )


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
    engine,
    train: list[Trajectory],
    held_out: list[Trajectory],
    pad_id: int,
    s: FitSettings,
    best_dir: Path,
    log: Log = print,
    comm: Collective = SOLO,
) -> tuple[list[float], int]:
    """Epochs of minibatch updates until the held-out explained variance has not improved for `s.patience`
    epochs (or `s.max_epochs`); the critic (`engine.module`) ends with the best epoch's weights, kept meanwhile as the
    engine's own files in `best_dir` (a directory every rank sees). Under torchrun every rank calls this with the
    same trajectories and takes its rows of each minibatch.

    Returns (held-out EV per epoch, index 0 the critic as it came in; the best epoch)."""
    held_batches = _batches(held_out, s.batch_size, pad_id)
    history = [held_out_ev(engine.module, held_batches, s.gamma, s.lam, comm, s.micro_batch_tokens)]
    log(f"value-pretrain: epoch 0 (cold critic) held-out EV {history[0]:.3f}")
    best_epoch = 0
    engine.save(best_dir)
    order = list(train)
    rng = random.Random(s.seed)
    for epoch in range(1, s.max_epochs + 1):
        rng.shuffle(order)
        loss = _epoch(engine, _batches(order, s.batch_size, pad_id), s, comm)
        history.append(held_out_ev(engine.module, held_batches, s.gamma, s.lam, comm, s.micro_batch_tokens))
        if history[epoch] > history[best_epoch]:
            best_epoch = epoch
            engine.save(best_dir)
        log(
            f"value-pretrain: epoch {epoch}/{s.max_epochs} loss {loss:.4f} held-out EV {history[epoch]:.3f} "
            f"(best {history[best_epoch]:.3f} at epoch {best_epoch})"
        )
        if epoch - best_epoch >= s.patience:
            break
    if best_epoch != len(history) - 1:
        engine.load(best_dir)
    return history, best_epoch


def held_out_ev(
    critic: ValueModel,
    batches: list[TrainBatch],
    gamma: float,
    lam: float,
    comm: Collective = SOLO,
    micro_batch_tokens: int = 0,
) -> float:
    """`explained_variance` of the critic's values against their targets over every action token of
    `batches` together (not a mean of per-batch EVs); every rank its rows, the tokens gathered in rank order."""
    values, targets = [], []
    with torch.no_grad():
        for batch in batches:
            mine, idle = rank_share(batch, comm)
            micro = MicroBatches.plan(mine, micro_batch_tokens, comm, idle)
            for i in range(len(micro)):
                mb = micro.take(mine, i)
                v = critic(mb["input_ids"], mb["attention_mask"])
                if micro.empty[i]:  # every rank runs the same passes (micro.py)
                    continue
                acting = mb["action_mask"].bool()
                values.append(v[acting])
                targets.append(value_targets(mb, v, gamma, lam)[acting])
    v = torch.cat(values) if values else torch.zeros(0)
    r = torch.cat(targets) if targets else torch.zeros(0)
    if comm.distributed:
        v, r = comm.gather_rows(v)[0], comm.gather_rows(r)[0]
    return float(explained_variance(v[None], r[None], torch.ones_like(v[None])))


def _epoch(engine, batches: list[TrainBatch], s: FitSettings, comm: Collective) -> float:
    """One pass: score every minibatch with the critic as the epoch starts (old values, targets), then one
    update per minibatch on the clipped value loss, each rank on its rows in micro-batches. Returns the mean loss."""
    critic = engine.module
    shares = [rank_share(b, comm) for b in batches]
    plans = [MicroBatches.plan(mine, s.micro_batch_tokens, comm, idle) for mine, idle in shares]
    with torch.no_grad():
        old = [
            [critic(mb["input_ids"], mb["attention_mask"]) for mb in (m.take(mine, i) for i in range(len(m)))]
            for (mine, _), m in zip(shares, plans)
        ]
    losses = []
    for (mine, _), micro, old_values in zip(shares, plans, old):
        weighted = TokenWeighted(micro)
        for i in range(len(micro)):
            mb = micro.take(mine, i)
            targets = value_targets(mb, old_values[i], s.gamma, s.lam)
            values = critic(mb["input_ids"], mb["attention_mask"])
            loss, metrics = clipped_value_loss(values, old_values[i], targets, mb["action_mask"], s.value_clip)
            if not engine.accumulate(loss * micro.share(i), last=micro.last(i)):
                break
            weighted.add(metrics, i)
        engine.apply()
        losses.append(float(weighted.result().get("critic/loss", math.nan)))
    return sum(losses) / len(losses)


def _batches(trajectories: list[Trajectory], size: int, pad_id: int) -> list[TrainBatch]:
    return [to_tensors(trajectories[i : i + size], pad_id) for i in range(0, len(trajectories), size)]

"""One trainer step per algorithm: SAO and the paper's baselines, all on the same batch tensors.

Each step takes a batch from `components.agent.trajectory.to_tensors`, the policy and (optionally) critic
engines, and an `AlgoSettings`; it updates the models in place and returns detached metrics named as in
DESIGN section 6. Dispatch is the plain dict `ALGORITHMS` keyed by the config's algorithm name.

SAO (DESIGN section 2; SAO paper, Algorithm 1):
  1. V_old = critic(batch); critic targets R = GAE(lam_critic) returns against V_old.
  2. K critic updates on the clipped value loss (attention frozen unless `sao-full-critic`).
  3. Advantages = skip-observation GAE(lam_policy) with the *updated* critic (the paper updates the critic
     first, then estimates advantages).
  4. One DIS policy update against the rollout log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from components.algo import (
    RunningMeanBaseline,
    broadcast_sequence_advantages,
    clipped_value_loss,
    dis_policy_loss,
    explained_variance,
    gae,
    grpo_advantages,
    masked_mean,
    masked_var,
    normalize_advantages,
    ppo_policy_loss,
)
from components.models import token_logprobs

AlgoName = Literal["sao", "sao-k1", "sao-full-critic", "sao-running-mean", "grpo", "grpo-dis", "ppo"]


@dataclass(frozen=True)
class AlgoSettings:
    """The numbers a step needs (resolved from the config once; math functions never see config objects)."""

    gamma: float
    lam_critic: float
    lam_policy: float
    eps_low: float
    eps_high: float
    temperature: float
    critic_updates: int
    value_clip: float
    normalize_advantages: bool
    ppo_clip: float = 0.2
    group_size: int = 1


def policy_update(policy, batch: dict[str, Tensor], advantages: Tensor, s: AlgoSettings, use_dis: bool) -> dict:
    """One policy optimizer step: DIS (mask outside the window) or PPO clip against the rollout log-probs."""
    act = batch["action_mask"]
    logprobs, entropy = token_logprobs(policy.module, batch["input_ids"], s.temperature, batch["attention_mask"],
                                       return_entropy=True)
    if use_dis:
        loss, metrics = dis_policy_loss(logprobs, batch["rollout_logprobs"], advantages, act, s.eps_low, s.eps_high)
    else:
        loss, metrics = ppo_policy_loss(logprobs, batch["rollout_logprobs"], advantages, act, s.ppo_clip, s.ppo_clip)
    metrics["policy/grad_norm"] = policy.backward_step(loss)
    metrics["policy/entropy"] = masked_mean(entropy, act)
    metrics["adv/mean"] = masked_mean(advantages, act)
    metrics["adv/std"] = masked_var(advantages, act).sqrt()
    return metrics


def critic_updates(critic, batch: dict[str, Tensor], s: AlgoSettings, updates: int) -> tuple[Tensor, dict]:
    """K critic steps on the clipped value loss; returns the updated critic's values and metrics."""
    ids, att, act, rewards = batch["input_ids"], batch["attention_mask"], batch["action_mask"], batch["rewards"]
    with torch.no_grad():
        old_values = critic.module(ids, att)
    _, returns = gae(rewards, old_values, act, s.gamma, s.lam_critic)
    metrics: dict[str, Tensor] = {}
    for _ in range(updates):
        values = critic.module(ids, att)
        loss, metrics = clipped_value_loss(values, old_values, returns, act, s.value_clip)
        metrics["critic/grad_norm"] = critic.backward_step(loss)
    with torch.no_grad():
        new_values = critic.module(ids, att)
    metrics["critic/explained_variance"] = explained_variance(new_values, returns, act)
    return new_values, metrics


def _critic_step(policy, critic, batch, s: AlgoSettings, use_dis: bool) -> dict:
    values, metrics = critic_updates(critic, batch, s, s.critic_updates)
    advantages, _ = gae(batch["rewards"], values, batch["action_mask"], s.gamma, s.lam_policy)
    if s.normalize_advantages:
        advantages = normalize_advantages(advantages, batch["action_mask"])
    metrics.update(policy_update(policy, batch, advantages, s, use_dis))
    return metrics


def sao_step(policy, critic, batch, s: AlgoSettings, state: dict) -> dict:
    return _critic_step(policy, critic, batch, s, use_dis=True)


def ppo_step(policy, critic, batch, s: AlgoSettings, state: dict) -> dict:
    return _critic_step(policy, critic, batch, s, use_dis=False)


def running_mean_step(policy, critic, batch, s: AlgoSettings, state: dict) -> dict:
    """SAO without a critic: advantage = outcome reward - mean of the last `window` rewards."""
    baseline: RunningMeanBaseline = state.setdefault("baseline", RunningMeanBaseline())
    seq_adv = baseline.advantages(batch["rewards"].sum(dim=1))
    advantages = broadcast_sequence_advantages(seq_adv, batch["action_mask"])
    return policy_update(policy, batch, advantages, s, use_dis=True)


def _grpo(policy, batch, s: AlgoSettings, use_dis: bool) -> dict:
    rewards = batch["rewards"].sum(dim=1)
    if rewards.numel() % s.group_size:
        raise ValueError(f"grpo: batch of {rewards.numel()} trajectories is not whole groups of {s.group_size}")
    # Rows arrive group by group (the buffer releases whole groups), so a reshape recovers the groups.
    seq_adv = grpo_advantages(rewards.view(-1, s.group_size)).reshape(-1)
    advantages = broadcast_sequence_advantages(seq_adv, batch["action_mask"])
    return policy_update(policy, batch, advantages, s, use_dis)


def grpo_step(policy, critic, batch, s: AlgoSettings, state: dict) -> dict:
    return _grpo(policy, batch, s, use_dis=False)


def grpo_dis_step(policy, critic, batch, s: AlgoSettings, state: dict) -> dict:
    return _grpo(policy, batch, s, use_dis=True)


@dataclass(frozen=True)
class Algorithm:
    step: Callable[..., dict]
    """The step function."""
    uses_critic: bool
    """Builds and trains a value model."""
    freeze_critic_attention: bool
    """Critic attention frozen (SAO) or full-parameter."""
    critic_updates: int | None
    """Overrides the configured K (None keeps it)."""
    grouped: bool
    """One prompt is sampled `group_size` times and trained as a group (GRPO's barrier)."""


ALGORITHMS: dict[str, Algorithm] = {
    "sao": Algorithm(sao_step, True, True, None, False),
    "sao-k1": Algorithm(sao_step, True, True, 1, False),
    "sao-full-critic": Algorithm(sao_step, True, False, None, False),
    "sao-running-mean": Algorithm(running_mean_step, False, False, None, False),
    "grpo": Algorithm(grpo_step, False, False, None, True),
    "grpo-dis": Algorithm(grpo_dis_step, False, False, None, True),
    "ppo": Algorithm(ppo_step, True, False, 1, False),
}

"""One trainer step per algorithm: SAO and the paper's baselines, all on the same batch tensors.

Each step takes a batch from `components.contracts.trajectory.to_tensors`, the policy and (optionally) critic
engines, and an `AlgoSettings`; it updates the models in place and returns detached metrics named as in
docs/design.md section 6. Dispatch is the plain dict `ALGORITHMS` keyed by the config's algorithm name.

SAO (docs/design.md section 2; SAO paper, Algorithm 1):
  1. V_old = critic(batch); critic targets R = GAE(lam_critic) returns against V_old.
  2. K critic updates on the clipped value loss (attention frozen unless `sao-full-critic`).
  3. Advantages = skip-observation GAE(lam_policy) with the *updated* critic (the paper updates the critic
     first, then estimates advantages).
  4. One DIS policy update against the rollout log-probs.

Every step also takes a `Collective` (`components/training/engines/collective.py`): with one rank it is the
identity; under torchrun each rank holds some rows of the batch and the step stays exactly the
single-process step of the whole batch (global token counts, moments and metrics).

Non-finite inputs skip updates rather than train on garbage, because the losses do not always turn them into
a non-finite loss the engines would catch: DIS's window test is false for a NaN ratio, so the token is
silently masked, and PPO clamps an infinite log-ratio to a finite one. Each guard is decided on every rank
together (`Collective.all_true`) and counted by the engine it skips (`skip_update`):
- a step whose batch holds a non-finite reward, or rollout log-prob on an action token, skips all its updates
  (before the running-mean baseline sees the rewards);
- the K critic updates are skipped when the critic's values or the returns are non-finite on action tokens;
- the policy update is skipped when its log-probs or advantages are (e.g. advantages from non-finite values).
A non-finite loss or gradient is the engines' guard (`engines.py`). Finite inputs go through unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

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
    normalize_advantages,
    ppo_policy_loss,
)
from components.config import AlgoName, Config
from components.models.logprobs import TokenStats, head_positions, token_logprobs
from components.training.engines.collective import SOLO, Collective, global_moments
from components.training.engines.micro import MicroBatches, TokenWeighted
from components.training.rl.diagnostics import policy_diagnostics


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
    micro_batch_tokens: int = 0
    """Padded tokens per forward/backward pass on each rank (0: a rank's rows in one pass; micro.py)."""
    skip_observations: bool = True
    """Skip-observation GAE (False: the ablation that steps through observation tokens; algo/gae.py)."""


class PolicyPasses:
    """A policy update's micro-batches (micro.py) and their forward passes, which need only the batch: the
    advantages join at the loss. `PolicyPasses(...)` plans the micro-batches (collectively over `comm`) and runs the
    first one's forward, keeping its graph, so a caller can begin the update before the advantages exist (the
    policy ranks do while the critic on ranks of its own runs its K updates: placement.py); `finish` runs the losses,
    backwards and the optimizer step. The same passes in the same order as one call, so the same numbers, and at
    most one micro-batch's graph alive at a time, as without the early start."""

    def __init__(self, policy, batch: dict[str, Tensor], s: AlgoSettings, comm: Collective = SOLO) -> None:
        self.policy, self.batch, self.s, self.comm = policy, batch, s, comm
        self.micro = MicroBatches.plan(batch, s.micro_batch_tokens, comm)
        self.first = self._forward(0)

    def _forward(self, i: int) -> tuple[dict[str, Tensor], Tensor, TokenStats]:
        mb = self.micro.take(self.batch, i)
        logprobs, stats = token_logprobs(
            self.policy.module,
            mb["input_ids"],
            self.s.temperature,
            mb["attention_mask"],
            return_stats=True,
            positions=head_positions(self.policy.module, mb["action_mask"]),
        )
        return mb, logprobs, stats

    def finish(self, advantages: Tensor, use_dis: bool) -> dict:
        """The loss of every micro-batch against `advantages` (the rank's rows), accumulated into one step."""
        policy, micro, s, act = self.policy, self.micro, self.s, self.batch["action_mask"]
        weighted, pieces = TokenWeighted(micro), []
        for i in range(len(micro)):
            mb, logprobs, stats = self.first if i == 0 else self._forward(i)
            self.first = None  # its graph goes with its backward
            a, adv = mb["action_mask"], micro.take({**self.batch, "advantages": advantages}, i)["advantages"]
            finite = bool(torch.isfinite(logprobs.detach()[a.bool()]).all())
            if use_dis:
                loss, metrics = dis_policy_loss(logprobs, mb["rollout_logprobs"], adv, a, s.eps_low, s.eps_high)
            else:
                loss, metrics = ppo_policy_loss(logprobs, mb["rollout_logprobs"], adv, a, s.ppo_clip, s.ppo_clip)
            metrics["policy/entropy"] = masked_mean(stats.entropy, a)
            if not policy.accumulate(loss * micro.share(i), last=micro.last(i), finite=finite):
                return {"policy/grad_norm": policy.apply()}
            weighted.add(metrics, i)
            pieces.append(None if micro.empty[i] else stats)
        grad_norm = policy.apply()
        metrics = weighted.result()
        stats = TokenStats(
            micro.assemble([p and p.entropy for p in pieces], act),
            micro.assemble([p and p.is_argmax for p in pieces], act),
        )
        metrics.update(policy_diagnostics(stats, advantages, self.batch, self.comm))
        metrics["policy/grad_norm"] = grad_norm
        adv_mean, adv_var = global_moments(advantages, act, self.comm)
        metrics["adv/mean"], metrics["adv/std"] = adv_mean, adv_var.sqrt()
        return metrics


def policy_update(
    policy,
    batch: dict[str, Tensor],
    advantages: Tensor,
    s: AlgoSettings,
    use_dis: bool,
    comm: Collective = SOLO,
    begun: PolicyPasses | None = None,
) -> dict:
    """One policy optimizer step: DIS (mask outside the window) or PPO clip against the rollout log-probs, over the
    rank's micro-batches (micro.py). Non-finite advantages or rollout log-probs skip it before any backward; a
    non-finite log-prob in any micro-batch on any rank skips it at that micro-batch. `begun`: the update's
    `PolicyPasses`, started on `batch` before the advantages were known (a skipped update drops its graph)."""
    act = batch["action_mask"]
    if not all_finite(act, comm, batch["rollout_logprobs"], advantages):
        return {"policy/grad_norm": policy.skip_update()}
    return (begun or PolicyPasses(policy, batch, s, comm)).finish(advantages, use_dis)


def critic_updates(
    critic, batch: dict[str, Tensor], s: AlgoSettings, updates: int, comm: Collective = SOLO
) -> tuple[Tensor, dict]:
    """K critic steps on the clipped value loss, each over the rank's micro-batches (micro.py); returns the updated
    critic's values and metrics. Non-finite values or returns on action tokens (the first update's forward) skip
    all K steps and return NaN values (the policy update then skips too: its advantages are not finite); a
    non-finite loss in a later update skips that update."""
    act = batch["action_mask"]
    micro = MicroBatches.plan(batch, s.micro_batch_tokens, comm)
    old, targets = [None] * len(micro), [None] * len(micro)
    metrics: dict[str, Tensor] = {}
    for update in range(updates):
        weighted, stopped = TokenWeighted(micro), False
        for i in range(len(micro)):
            mb = micro.take(batch, i)
            a = mb["action_mask"]
            values = critic.module(mb["input_ids"], mb["attention_mask"])
            finite = True
            if update == 0:
                # The first update's forward runs on the weights V_old comes from, so it is V_old: one forward, not
                # two. GAE runs along each row, so a micro-batch's returns need only its own rows' values.
                old[i] = values.detach()
                targets[i] = gae(mb["rewards"], old[i], a, s.gamma, s.lam_critic, s.skip_observations)[1]
                keep = a.bool()
                finite = bool(torch.isfinite(old[i][keep]).all() and torch.isfinite(targets[i][keep]).all())
            loss, part = clipped_value_loss(values, old[i], targets[i], a, s.value_clip)
            if not critic.accumulate(loss * micro.share(i), last=micro.last(i), finite=finite):
                stopped = True
                break
            weighted.add(part, i)
        norm = critic.apply()
        if update == 0 and stopped:
            rest = [critic.skip_update() for _ in range(updates - 1)]
            return torch.full_like(act, math.nan), {"critic/grad_norm": (rest or [norm])[-1]}
        metrics = {**weighted.result(), "critic/grad_norm": norm}
    returns = micro.assemble([None if e else t for t, e in zip(targets, micro.empty)], act)
    pieces = []
    with torch.no_grad():
        for i in range(len(micro)):  # empty passes too: every rank runs the same passes (micro.py)
            mb = micro.take(batch, i)
            values = critic.module(mb["input_ids"], mb["attention_mask"])
            pieces.append(None if micro.empty[i] else values)
    new_values = micro.assemble(pieces, act)
    metrics["critic/explained_variance"] = explained_variance(new_values, returns, act, var=_variance(comm))
    return new_values, metrics


def all_finite(mask: Tensor, comm: Collective, *tensors: Tensor) -> bool:
    """Every `(B, T)` tensor finite where `mask` is 1, on every rank (ranks skip an update together). Positions
    off the mask are not read: padding and observations may hold anything there (docs/design.md section 2)."""
    keep = mask.bool()
    return comm.all_true(all(bool(torch.isfinite(t[keep]).all()) for t in tensors))


def _skip_critic(critic, updates: int) -> Tensor:
    """Skip (and count) all `updates` critic updates of a step (K >= 1, `algo.critic_updates`)."""
    return [critic.skip_update() for _ in range(updates)][-1]


def finite_inputs(step: Callable[..., dict]) -> Callable[..., dict]:
    """`step`, skipping every update of the step (counted on each engine) when the batch holds a non-finite
    reward (anywhere: GRPO and the running mean sum whole rows) or rollout log-prob on an action token."""

    @functools.wraps(step)
    def guarded(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
        if inputs_finite(batch, comm):
            return step(policy, critic, batch, s, state, comm)
        metrics = {"policy/grad_norm": policy.skip_update()}
        if critic is not None:
            metrics["critic/grad_norm"] = _skip_critic(critic, s.critic_updates)
        return metrics

    return guarded


def _variance(comm: Collective):
    return lambda x, mask: global_moments(x, mask, comm)[1]


def _critic_step(policy, critic, batch, s: AlgoSettings, use_dis: bool, comm: Collective) -> dict:
    with critic.busy():  # the K updates and the updated critic's values (the loop benchmark's split)
        values, metrics = critic_updates(critic, batch, s, s.critic_updates, comm)
    metrics.update(policy_update(policy, batch, policy_advantages(batch, values, s, comm), s, use_dis, comm))
    return metrics


def policy_advantages(batch: dict[str, Tensor], values: Tensor, s: AlgoSettings, comm: Collective = SOLO) -> Tensor:
    """The policy's advantages from the updated critic's `(B, T)` values: skip-observation GAE at `lam_policy`,
    whitened over every rank's action tokens when `normalize_advantages`."""
    act = batch["action_mask"]
    advantages, _ = gae(batch["rewards"], values, act, s.gamma, s.lam_policy, s.skip_observations)
    if s.normalize_advantages:
        advantages = normalize_advantages(advantages, act, moments=lambda x, m: global_moments(x, m, comm))
    return advantages


def inputs_finite(batch: dict[str, Tensor], comm: Collective = SOLO) -> bool:
    """Every reward and every rollout log-prob on an action token finite, on every rank of `comm` (`finite_inputs`'
    check, decided together)."""
    acting = batch["action_mask"].bool()
    rewards_ok = torch.isfinite(batch["rewards"]).all()
    return comm.all_true(bool(rewards_ok & torch.isfinite(batch["rollout_logprobs"][acting]).all()))


@finite_inputs
def sao_step(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
    return _critic_step(policy, critic, batch, s, True, comm)


@finite_inputs
def ppo_step(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
    return _critic_step(policy, critic, batch, s, False, comm)


@finite_inputs
def running_mean_step(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
    """SAO without a critic: advantage = outcome reward - mean of the last `window` rewards (of all ranks)."""
    baseline: RunningMeanBaseline = state.setdefault("baseline", RunningMeanBaseline())
    local = batch["rewards"].sum(dim=1)
    rewards, offset = comm.gather_rows(local)
    seq_adv = baseline.advantages(rewards)[offset : offset + len(local)]
    advantages = broadcast_sequence_advantages(seq_adv, batch["action_mask"])
    return policy_update(policy, batch, advantages, s, True, comm)


def _grpo(policy, batch, s: AlgoSettings, use_dis: bool, comm: Collective) -> dict:
    rewards = batch["rewards"].sum(dim=1)
    if rewards.numel() % s.group_size:
        raise ValueError(f"grpo: batch of {rewards.numel()} trajectories is not whole groups of {s.group_size}")
    # Rows arrive group by group (the buffer releases whole groups, ranks get whole groups), so a reshape
    # recovers the groups.
    seq_adv = grpo_advantages(rewards.view(-1, s.group_size)).reshape(-1)
    advantages = broadcast_sequence_advantages(seq_adv, batch["action_mask"])
    return policy_update(policy, batch, advantages, s, use_dis, comm)


@finite_inputs
def grpo_step(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
    return _grpo(policy, batch, s, False, comm)


@finite_inputs
def grpo_dis_step(policy, critic, batch, s: AlgoSettings, state: dict, comm: Collective = SOLO) -> dict:
    return _grpo(policy, batch, s, True, comm)


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
    dis: bool = True
    """The policy loss is DIS (else PPO's clip): what a critic algorithm's policy ranks run when the critic sits
    on ranks of its own (`train.critic_ranks`, components/training/rl/learner.py)."""


ALGORITHMS: dict[AlgoName, Algorithm] = {
    "sao": Algorithm(sao_step, True, True, None, False),
    "sao-k1": Algorithm(sao_step, True, True, 1, False),
    "sao-full-critic": Algorithm(sao_step, True, False, None, False),
    "sao-running-mean": Algorithm(running_mean_step, False, False, None, False),
    "grpo": Algorithm(grpo_step, False, False, None, True),
    "grpo-dis": Algorithm(grpo_dis_step, False, False, None, True),
    "ppo": Algorithm(ppo_step, True, False, 1, False, dis=False),
}


def settings_from(cfg: Config) -> AlgoSettings:
    """The numbers a step needs, resolved from a config once (the steps never see config objects)."""
    algorithm = ALGORITHMS[cfg.train.algo]
    eps_low, eps_high = cfg.algo.dis_window
    return AlgoSettings(
        cfg.algo.gamma,
        cfg.algo.lam_critic,
        cfg.algo.lam_policy,
        eps_low,
        eps_high,
        cfg.algo.temperature,
        algorithm.critic_updates or cfg.algo.critic_updates,
        cfg.algo.value_clip,
        cfg.algo.normalize_advantages,
        group_size=cfg.train.group_size if algorithm.grouped else 1,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        skip_observations=cfg.algo.skip_observations,
    )

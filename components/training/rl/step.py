"""The one trainer step, for SAO and every baseline (algorithms.py), wherever the critic runs (placement.py).

    guard       a batch holding a non-finite reward or rollout log-prob skips every update of the step
    advantages  by the algorithm's estimator:
                  gae           the critic's K updates first, then skip-observation GAE at lam_policy with the
                                *updated* critic (the paper updates the critic, then estimates advantages: SAO paper,
                                Algorithm 1; docs/design.md section 2), whitened when `normalize_advantages`
                  running-mean  outcome reward - the mean of the last rewards of every rank
                  grpo          GRPO's group-normalised outcome reward
    policy      one update with the algorithm's loss (DIS or PPO's clip) against the rollout log-probs

The placement is a parameter: with the critic on ranks of its own, those ranks run the K updates while the policy's
ranks start their first forward pass, and rank 0 turns the critic's values into the whole batch's advantages
(placement.py); with both models on every rank (the default) the same step runs on each rank's rows.

Non-finite inputs skip updates rather than train on garbage, because the losses do not always turn them into a
non-finite loss the engines would catch: DIS's window test is false for a NaN ratio, so the token is silently
masked, and PPO clamps an infinite log-ratio to a finite one. Each guard is decided on every rank together
(`Collective.all_true`) and counted by the engine it skips (`skip_update`):
- a step whose batch holds a non-finite reward, or rollout log-prob on an action token, skips all its updates
  (before the running-mean baseline sees the rewards);
- the K critic updates are skipped when the critic's values or the returns are non-finite on action tokens;
- the policy update is skipped when its log-probs or advantages are (e.g. advantages from non-finite values).
A non-finite loss or gradient is the engines' guard (engines/engine.py). Finite inputs go through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from components.algo import (
    RunningMeanBaseline,
    broadcast_sequence_advantages,
    explained_variance,
    gae,
    gae_by_row,
    grpo_advantages,
    length_adaptive_lambda,
    normalize_advantages,
)
from components.training.engines.collective import SOLO, Collective, global_moments
from components.training.rl.algorithms import AlgoSettings
from components.training.rl.passes import PolicyPasses, critic_updates, policy_update
from components.training.rl.placement import Placement, Together

TOGETHER = Together()
"""One process holding both models."""


class Estimate(NamedTuple):
    advantages: Tensor | None
    """This rank's rows' `(B, T)` advantages (None on a critic rank: its part of the step is done)."""
    metrics: dict
    """The estimator's metrics (the critic's, on the rank that reports them)."""
    begun: PolicyPasses | None = None
    """The policy update's passes, begun while the critic updated (ranks of its own), else None."""


def train_step(
    policy,
    critic,
    rows: dict[str, Tensor],
    s: AlgoSettings,
    state: dict,
    where: Placement = TOGETHER,
    whole: dict[str, Tensor] | None = None,
    update_policy: bool = True,
    version: int = -1,
) -> dict:
    """One step on this rank's `rows` (`to_tensors`' dict of `(B, T)` tensors); updates the engines this rank holds in
    place and returns the step's detached metrics (docs/design.md section 6; on rank 0, whole-batch ones). `state` is
    the algorithm's own (the running-mean baseline); `whole` the whole batch on rank 0 of an `Apart` placement.
    `update_policy=False` (the critic's warm-up) runs the critic's K updates and the advantages, not the policy's
    update: its weights stay as they are. `version`: the policy version being trained (`rollout/mismatch_kl`)."""
    if not inputs_finite(rows, where.world):
        return where.skipped(skip_updates(policy, critic, s, where, update_policy))
    estimate = ESTIMATORS[s.advantage](policy if update_policy else None, critic, rows, whole, s, state, where)
    if estimate.advantages is None or not update_policy:
        return estimate.metrics
    update = policy_update(policy, rows, estimate.advantages, s, where.group, estimate.begun, version)
    return {**estimate.metrics, **update}


def critic_advantages(
    policy, critic, rows: dict, whole: dict | None, s: AlgoSettings, state: dict, where: Placement
) -> Estimate:
    """SAO's and PPO's: the critic's K updates (where it runs), then GAE from the updated critic's values."""
    values, metrics, begun = None, {}, None
    if where.holds_critic:
        with critic.busy():  # the K updates and the updated critic's values (the loop benchmark's split)
            values, metrics = critic_updates(critic, rows, s, s.critic_updates, where.group)
        if where.reports_critic_skips:
            metrics["trainer/critic_skipped_steps"] = torch.tensor(float(critic.skipped_steps))
    elif where.overlap and policy is not None:  # during the critic's K updates on its own ranks (not in warm-up)
        begun = PolicyPasses(policy, rows, s, where.group)
    whitened: list[bool] = []  # decided where the advantages are estimated (rank 0 of an Apart placement)

    def estimate(batch: dict[str, Tensor], v: Tensor, comm: Collective) -> Tensor:
        whitened.append(whitens(batch, v, s, comm))
        return policy_advantages(batch, v, s, whitened[-1], comm)

    advantages, metrics = where.exchange(rows, whole, values, metrics, estimate)
    if whitened and s.whiten_below_ev is not None:
        metrics = {**metrics, "policy/advantages_whitened": torch.tensor(float(whitened[-1]))}
    return Estimate(advantages, metrics, begun)


def policy_advantages(
    batch: dict[str, Tensor], values: Tensor, s: AlgoSettings, whiten: bool = False, comm: Collective = SOLO
) -> Tensor:
    """The policy's advantages from the updated critic's `(B, T)` values: skip-observation GAE at `lam_policy` (or
    each row's length-adaptive lambda, `lam_length_alpha`), whitened over every rank's action tokens when `whiten`
    (`whitens` decides)."""
    act = batch["action_mask"]
    if s.lam_length_alpha > 0:
        lams = length_adaptive_lambda(act, s.lam_length_alpha)
        advantages, _ = gae_by_row(batch["rewards"], values, act, s.gamma, lams, s.skip_observations)
    else:
        advantages, _ = gae(batch["rewards"], values, act, s.gamma, s.lam_policy, s.skip_observations)
    if whiten:
        advantages = normalize_advantages(advantages, act, moments=lambda x, m: global_moments(x, m, comm))
    return advantages


def whitens(batch: dict[str, Tensor], values: Tensor, s: AlgoSettings, comm: Collective = SOLO) -> bool:
    """`normalize_advantages`, or (`whiten_below_ev`) the updated critic's explained variance of the `lam_critic`
    returns over every rank's action tokens below the threshold (the same on every rank)."""
    if s.normalize_advantages or s.whiten_below_ev is None:
        return s.normalize_advantages
    act = batch["action_mask"]
    returns = gae(batch["rewards"], values, act, s.gamma, s.lam_critic, s.skip_observations)[1]
    ev = explained_variance(values, returns, act, var=lambda x, mask: global_moments(x, mask, comm)[1])
    return bool(ev < s.whiten_below_ev)


def running_mean_advantages(
    policy, critic, rows: dict, whole: dict | None, s: AlgoSettings, state: dict, where: Placement
) -> Estimate:
    """SAO without a critic: advantage = outcome reward - mean of the last `window` rewards (of all ranks)."""
    baseline: RunningMeanBaseline = state.setdefault("baseline", RunningMeanBaseline())
    local = rows["rewards"].sum(dim=1)
    rewards, offset = where.group.gather_rows(local)
    seq_adv = baseline.advantages(rewards)[offset : offset + len(local)]
    return Estimate(broadcast_sequence_advantages(seq_adv, rows["action_mask"]), {})


def group_advantages(
    policy, critic, rows: dict, whole: dict | None, s: AlgoSettings, state: dict, where: Placement
) -> Estimate:
    """GRPO's: each trajectory's outcome reward normalised within its group of `group_size`."""
    rewards = rows["rewards"].sum(dim=1)
    if rewards.numel() % s.group_size:
        raise ValueError(f"grpo: batch of {rewards.numel()} trajectories is not whole groups of {s.group_size}")
    # Rows arrive group by group (the buffer releases whole groups, ranks get whole groups), so a reshape
    # recovers the groups.
    seq_adv = grpo_advantages(rewards.view(-1, s.group_size)).reshape(-1)
    return Estimate(broadcast_sequence_advantages(seq_adv, rows["action_mask"]), {})


ESTIMATORS: dict[str, Callable[..., Estimate]] = {
    "gae": critic_advantages,
    "running-mean": running_mean_advantages,
    "grpo": group_advantages,
}
"""The advantage estimators by `AlgoSettings.advantage`."""


def inputs_finite(batch: dict[str, Tensor], comm: Collective = SOLO) -> bool:
    """Every reward (anywhere: GRPO and the running mean sum whole rows) and every rollout log-prob on an action
    token finite, on every rank of `comm` (decided together)."""
    acting = batch["action_mask"].bool()
    rewards_ok = torch.isfinite(batch["rewards"]).all()
    return comm.all_true(bool(rewards_ok & torch.isfinite(batch["rollout_logprobs"][acting]).all()))


def skip_updates(policy, critic, s: AlgoSettings, where: Placement, update_policy: bool = True) -> dict:
    """Skip (and count) every update of the step on the engines this rank holds: the policy's (when the step would
    have updated it), and the critic's K (`algo.critic_updates`)."""
    metrics = {}
    if where.holds_policy and update_policy:
        metrics["policy/grad_norm"] = policy.skip_update()
    if where.holds_critic and critic is not None:
        metrics["critic/grad_norm"] = [critic.skip_update() for _ in range(s.critic_updates)][-1]
        if where.reports_critic_skips:
            metrics["trainer/critic_skipped_steps"] = torch.tensor(float(critic.skipped_steps))
    return metrics

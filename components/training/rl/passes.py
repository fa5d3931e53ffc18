"""The model passes of one step: the policy update (DIS or PPO's clip against the rollout log-probs) and the critic's
K updates, each over a rank's micro-batches (engines/micro.py), reducing over the ranks that train the model.

Every function takes the engines, the batch (or a rank's rows of it: `components.contracts.trajectory.to_tensors`'
dict of `(B, T)` tensors), an `AlgoSettings` and a `Collective`; it updates the engine in place and returns detached
metrics named as in docs/design.md section 6. With one rank the `Collective` is the identity (`SOLO`); under torchrun
every sum is the whole batch's, so the ranks take exactly the single-process step of the whole batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from components.algo import (
    anchor_kl,
    clipped_value_loss,
    dis_policy_loss,
    explained_variance,
    gae,
    masked_mean,
    ppo_policy_loss,
)
from components.models.logprobs import TokenStats, head_positions, token_logprobs
from components.models.routing import replay
from components.training.engines.collective import SOLO, Collective, global_moments
from components.training.engines.micro import MicroBatches, TokenWeighted, split_rows
from components.training.rl.algorithms import AlgoSettings
from components.training.rl.diagnostics import policy_diagnostics

LOSSES = {
    "dis": lambda logprobs, mb, adv, s: dis_policy_loss(
        logprobs, mb["rollout_logprobs"], adv, mb["action_mask"], s.eps_low, s.eps_high
    ),
    "ppo": lambda logprobs, mb, adv, s: ppo_policy_loss(
        logprobs, mb["rollout_logprobs"], adv, mb["action_mask"], s.ppo_clip, s.ppo_clip
    ),
}
"""The policy losses by `AlgoSettings.loss`: (log-probs, micro-batch, its advantages, settings) -> (loss, metrics)."""


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
        if "routes" in mb:  # routing replay: this micro-batch's tokens, in its forward and in its backward's recompute
            replay(self.policy.module, mb["routes"])
        logprobs, stats = token_logprobs(
            self.policy.module,
            mb["input_ids"],
            self.s.temperature,
            mb["attention_mask"],
            return_stats=True,
            positions=head_positions(self.policy.module, mb["action_mask"]),
        )
        return mb, logprobs, stats

    def finish(self, advantages: Tensor, version: int = -1) -> dict:
        """The loss (`AlgoSettings.loss`) of every micro-batch against `advantages` (the rank's rows), accumulated
        into one step; with the `version` being trained, the mismatch on the tokens it sampled."""
        try:
            return self._finish(advantages, version)
        finally:
            if "routes" in self.batch:  # the policy's next forwards route themselves
                replay(self.policy.module, None)

    def _finish(self, advantages: Tensor, version: int) -> dict:
        policy, micro, s, act = self.policy, self.micro, self.s, self.batch["action_mask"]
        weighted, pieces, mismatch = TokenWeighted(micro), [], Mismatch(version)
        for i in range(len(micro)):
            mb, logprobs, stats = self.first if i == 0 else self._forward(i)
            self.first = None  # its graph goes with its backward
            a, adv = mb["action_mask"], micro.take({**self.batch, "advantages": advantages}, i)["advantages"]
            finite = bool(torch.isfinite(logprobs.detach()[a.bool()]).all())
            loss, metrics = LOSSES[s.loss](logprobs, mb, adv, s)
            if s.kl_anchor:  # toward the SFT policy's log-probs of the same tokens (the learner computed them)
                kl = anchor_kl(logprobs, mb["reference_logprobs"], a)
                loss, metrics["policy/kl_anchor"] = loss + s.kl_anchor * kl, kl.detach()
            metrics["policy/entropy"] = masked_mean(stats.entropy, a)
            if not policy.accumulate(loss * micro.share(i), last=micro.last(i), finite=finite):
                return {"policy/grad_norm": policy.apply()}
            weighted.add(metrics, i)
            mismatch.add(logprobs, mb)
            pieces.append(None if micro.empty[i] else stats)
        grad_norm = policy.apply()
        metrics = {**weighted.result(), **mismatch.result(self.comm)}
        stats = TokenStats(
            micro.assemble([p and p.entropy for p in pieces], act),
            micro.assemble([p and p.is_argmax for p in pieces], act),
        )
        metrics.update(policy_diagnostics(stats, advantages, self.batch, self.comm))
        metrics["policy/grad_norm"] = grad_norm
        adv_mean, adv_var = global_moments(advantages, act, self.comm)
        metrics["adv/mean"], metrics["adv/std"] = adv_mean, adv_var.sqrt()
        return metrics


@torch.no_grad()
def reference_logprobs(reference: torch.nn.Module, batch: dict[str, Tensor], s: AlgoSettings) -> Tensor:
    """`(B, T)` log-probs at `s.temperature` of every token of `batch` under the frozen `reference` (the SFT policy
    of `algo.kl_anchor`), over row ranges of at most `s.micro_batch_tokens` padded tokens (0 in the other places)."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=batch["input_ids"].device)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    for rows in split_rows(lengths, s.micro_batch_tokens):
        width = max(lengths[rows.start : rows.stop])
        part = {k: batch[k][rows.start : rows.stop, :width] for k in ("input_ids", "attention_mask", "action_mask")}
        out[rows.start : rows.stop, :width] = token_logprobs(
            reference,
            part["input_ids"],
            s.temperature,
            part["attention_mask"],
            positions=head_positions(reference, part["action_mask"]),
        ).float()
    return out


class Mismatch:
    """`rollout/mismatch_kl`: the k3 estimate of KL(engine || trainer), `(r - 1) - log r` with `r` the trainer's
    probability of a sampled token over the engine's logged one, over the action tokens sampled at the `version`
    being trained, whose trainer log-probs are the sampling weights' own: what remains is the engine's numerics
    (its dtype, kernels, MoE routing), not policy lag. Summed over micro-batches and ranks; absent when no token of
    the batch was sampled at that version (every token stale) or the version is not known."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.k3: Tensor | float = 0.0  # on the log-probs' device until `result`: no host sync per micro-batch
        self.tokens: Tensor | float = 0.0

    def add(self, logprobs: Tensor, mb: dict[str, Tensor]) -> None:
        if self.version < 0:
            return
        match = mb["action_mask"].bool() & (mb["versions"] == self.version)
        # float64 and expm1: near 0, float32's exp(x) - 1 - x is all rounding (it even comes out negative)
        log_ratio = (logprobs.detach().double() - mb["rollout_logprobs"].double()).clamp(max=20.0)[match]
        self.k3 = self.k3 + (torch.expm1(log_ratio) - log_ratio).sum()
        self.tokens = self.tokens + match.sum()

    def result(self, comm: Collective) -> dict[str, Tensor]:
        if self.version < 0:
            return {}
        local = torch.tensor([float(self.k3), float(self.tokens)], dtype=torch.float64)  # host tensors: gloo's
        k3, tokens = comm.sum(local).unbind()
        return {"rollout/mismatch_kl": (k3 / tokens).float()} if tokens > 0 else {}


def policy_update(
    policy,
    batch: dict[str, Tensor],
    advantages: Tensor,
    s: AlgoSettings,
    comm: Collective = SOLO,
    begun: PolicyPasses | None = None,
    version: int = -1,
) -> dict:
    """One policy optimizer step against the rollout log-probs, over the rank's micro-batches (micro.py). Non-finite
    advantages or rollout log-probs skip it before any backward; a non-finite log-prob in any micro-batch on any rank
    skips it at that micro-batch. `begun`: the update's `PolicyPasses`, started on `batch` before the advantages were
    known (a skipped update drops its graph). `version`: the policy version being trained, for
    `rollout/mismatch_kl`."""
    act = batch["action_mask"]
    if not all_finite(act, comm, batch["rollout_logprobs"], advantages):
        return {"policy/grad_norm": policy.skip_update()}
    return (begun or PolicyPasses(policy, batch, s, comm)).finish(advantages, version)


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
    new_values = _updated_values(critic, batch, micro)
    metrics["critic/explained_variance"] = explained_variance(
        new_values, returns, act, var=lambda x, mask: global_moments(x, mask, comm)[1]
    )
    return new_values, metrics


def _updated_values(critic, batch: dict[str, Tensor], micro: MicroBatches) -> Tensor:
    """The updated critic's `(B, T)` values of the rank's rows, one no-grad forward per micro-batch (empty passes
    too: every rank runs the same passes, micro.py)."""
    pieces = []
    with torch.no_grad():
        for i in range(len(micro)):
            mb = micro.take(batch, i)
            values = critic.module(mb["input_ids"], mb["attention_mask"])
            pieces.append(None if micro.empty[i] else values)
    return micro.assemble(pieces, batch["action_mask"])


def all_finite(mask: Tensor, comm: Collective, *tensors: Tensor) -> bool:
    """Every `(B, T)` tensor finite where `mask` is 1, on every rank (ranks skip an update together). Positions
    off the mask are not read: padding and observations may hold anything there (docs/design.md section 2)."""
    keep = mask.bool()
    return comm.all_true(all(bool(torch.isfinite(t[keep]).all()) for t in tensors))

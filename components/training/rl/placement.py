"""The critic on ranks of its own (`train.critic_ranks` = c > 0): the policy trains on ranks 0 .. W-c-1, the critic on
the last c, each engine data-parallel over its own group (DeepSpeed's data-parallel group is the group's:
engines.py `GroupMPU`). A step:

    rank 0 scatters      each policy rank its rows of the batch, each critic rank its rows (each side splits the
                         batch over its own ranks), and itself the whole batch
    every rank           the batch guard, decided together: a non-finite reward or rollout log-prob skips the step
    critic ranks         K updates on their rows and the updated critic's values (reducing over the critic's group);
    policy ranks         meanwhile, their micro-batches planned and the first one's forward pass (algorithms.py
                         `PolicyPasses`: it needs no advantage)
    rank 0 gathers       every critic rank's values; the advantages of the whole batch (skip-observation GAE at
                         lam_policy, whitened over the whole batch when asked)
    rank 0 scatters      each policy rank its rows' advantages
    policy ranks         the policy update from that forward pass on (reducing over the policy's group)

Every sum is the whole batch's, as in the shared placement (collective.py), so both give the same step; a test runs
2 + 2 gloo ranks against one process holding both. What this placement buys is memory (a GPU holds one model;
`sao plan` prices it).

Limits: ZeRO stages 0-2 only (DeepSpeed 0.19's ZeRO-3 validates its parameter trace with broadcasts over every rank,
which an engine on part of the ranks cannot match; the learner refuses it), and each model loads whole on its
ranks' hosts before DeepSpeed partitions it. The overlap is one forward pass: the policy's backward needs the
advantages, which need the critic's updated values, so the rest of the policy's step waits for the critic's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from components.training.engines.collective import Collective, shard_rows, subgroup, take_rows
from components.training.rl.algorithms import (
    PolicyPasses,
    critic_updates,
    inputs_finite,
    policy_advantages,
    policy_update,
)


@dataclass(frozen=True)
class Placement:
    """Which ranks hold which model, and their groups."""

    world: Collective
    """Every rank (the learner's messages)."""
    policy_ranks: int
    critic_ranks: int
    group: Collective
    """This rank's group: the policy's or the critic's."""
    role: str
    """"policy" or "critic"."""

    @classmethod
    def split(cls, world: Collective, critic_ranks: int) -> Placement:
        """The last `critic_ranks` of `world` for the critic (every rank calls this: groups are made together)."""
        if not 0 < critic_ranks < world.world:
            raise ValueError(
                f"train.critic_ranks: {critic_ranks} leaves no rank for the policy or takes none for the critic "
                f"(1 to {world.world - 1} of the {world.world} ranks)"
            )
        policy = list(range(world.world - critic_ranks))
        critic = list(range(world.world - critic_ranks, world.world))
        mine = [subgroup(policy), subgroup(critic)]
        role = "policy" if world.rank < len(policy) else "critic"
        return cls(world, len(policy), critic_ranks, mine[0] or mine[1], role)

    def work(self, batch: dict[str, torch.Tensor], lr_scale: float) -> list:
        """Rank 0's scatter of one step: every rank's rows, and the whole batch for rank 0."""
        rows = len(batch["input_ids"])
        policy = [take_rows(batch, r) for r in shard_rows(rows, self.policy_ranks)]
        critic = [take_rows(batch, r) for r in shard_rows(rows, self.critic_ranks)]
        items = [("step", ("policy", part, lr_scale, None)) for part in policy]
        items += [("step", ("critic", part, lr_scale, None)) for part in critic]
        items[0] = ("step", ("policy", policy[0], lr_scale, batch))
        return items


def split_step(
    placement: Placement, policy, critic, rows: dict, whole: dict | None, s, dis: bool, overlap: bool = True
) -> dict:
    """This rank's part of one step (see the module docstring); whole-batch metrics on rank 0, {} elsewhere.
    `whole` is the whole batch on rank 0 (None elsewhere); `s` the `AlgoSettings`; `dis`: the policy loss is DIS
    (else PPO's clip). `overlap=False` waits for the critic before the policy's first forward pass (the same
    numbers; the placement benchmark's baseline)."""
    world = placement.world
    if not inputs_finite(rows, world):
        engine = policy if placement.role == "policy" else critic
        skipped = {"policy/grad_norm": engine.skip_update()} if placement.role == "policy" else _skip(critic, s)
        parts = world.gather(skipped if placement.role == "critic" else None)
        return {**skipped, **_critic_part(parts, placement)} if world.rank == 0 else {}
    if placement.role == "critic":
        with critic.busy():
            values, metrics = critic_updates(critic, rows, s, s.critic_updates, placement.group)
        metrics["trainer/critic_skipped_steps"] = torch.tensor(float(critic.skipped_steps))
        world.gather((values.detach().cpu(), metrics if placement.group.rank == 0 else None))
        world.scatter(None)
        return {}
    begun = PolicyPasses(policy, rows, s, placement.group) if overlap else None  # during the critic's K updates
    parts = world.gather(None)
    advantages = None
    if world.rank == 0:
        values = torch.cat([v for v, _ in parts[placement.policy_ranks :]]).to(whole["rewards"].device)
        advantages = policy_advantages(whole, values, s)
        split = [advantages[r.start : r.stop] for r in shard_rows(len(advantages), placement.policy_ranks)]
        advantages = world.scatter(split + [None] * placement.critic_ranks)
    else:
        advantages = world.scatter(None)
    advantages = advantages.to(rows["rewards"].device)
    metrics = policy_update(policy, rows, advantages, s, dis, placement.group, begun=begun)
    if world.rank == 0:
        metrics.update(_critic_part(parts, placement))
    return metrics


def _skip(critic, s) -> dict:
    """The K critic updates of a skipped step, counted."""
    norm = [critic.skip_update() for _ in range(s.critic_updates)][-1]
    return {"critic/grad_norm": norm, "trainer/critic_skipped_steps": torch.tensor(float(critic.skipped_steps))}


def _critic_part(parts: list, placement: Placement) -> dict:
    """The critic's metrics from the first critic rank's part of the gather."""
    first = parts[placement.policy_ranks]
    return first[1] if isinstance(first, tuple) else first

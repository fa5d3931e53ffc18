"""Where a step's models run: both on every rank (`Together`, the default), or the critic on ranks of its own
(`Apart`, `train.critic_ranks` = c > 0). The step (step.py) is written once; a placement is the parameter that says
which engines this rank holds, which ranks reduce together, and how the critic's values reach the policy.

Together: every rank holds both engines and its rows of the batch; the critic's K updates, the advantages (whitened
over every rank's action tokens) and the policy update all reduce over the same ranks (collective.py), so the step is
the single-process step of the whole batch.

Apart: the policy trains on ranks 0 .. W-c-1, the critic on the last c, each engine data-parallel over its own group
(DeepSpeed's data-parallel group is the group's: engines/engine.py `GroupMPU`). A step:

    rank 0 scatters      each policy rank its rows of the batch, each critic rank its rows (each side splits the
                         batch over its own ranks), and itself the whole batch
    every rank           the batch guard, decided together: a non-finite reward or rollout log-prob skips the step
    critic ranks         K updates on their rows and the updated critic's values (reducing over the critic's group);
    policy ranks         meanwhile, their micro-batches planned and the first one's forward pass (passes.py
                         `PolicyPasses`: it needs no advantage)
    rank 0 gathers       every critic rank's values; the advantages of the whole batch (skip-observation GAE at
                         lam_policy, whitened over the whole batch when asked)
    rank 0 scatters      each policy rank its rows' advantages
    policy ranks         the policy update from that forward pass on (reducing over the policy's group)

Every sum is the whole batch's, as Together's, so both give the same step; a test runs 2 + 2 gloo ranks against one
process holding both. What Apart buys is memory (a GPU holds one model; `sao plan` prices it).

Limits of Apart: ZeRO stages 0-2 only (DeepSpeed 0.19's ZeRO-3 validates its parameter trace with broadcasts over
every rank, which an engine on part of the ranks cannot match; the learner refuses it), and each model loads whole on
its ranks' hosts before DeepSpeed partitions it. The overlap is one forward pass: the policy's backward needs the
advantages, which need the critic's updated values, so the rest of the policy's step waits for the critic's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from components.training.engines.collective import SOLO, Collective, shard_rows, subgroup, take_rows

Estimate = Callable[[dict[str, Tensor], Tensor, Collective], Tensor]
"""(batch, the critic's `(B, T)` values, the ranks sharing the batch) -> the batch's `(B, T)` advantages."""


@dataclass(frozen=True)
class StepWork:
    """One rank's part of a step, as the learner hands it over."""

    rows: dict[str, Tensor]
    """This rank's rows of the batch (`to_tensors`' dict)."""
    lr_scale: float
    """Both learning rates at this times the configured ones."""
    whole: dict[str, Tensor] | None = None
    """The whole batch, on rank 0 of an `Apart` placement (it computes the whole batch's advantages); else None."""
    update_policy: bool = True
    """False during `train.critic_warmup_steps`: the critic's K updates only."""
    version: int = -1
    """The policy version being trained (the weights before this step's update; -1: not known): tokens it sampled
    measure the engine's mismatch, `rollout/mismatch_kl`."""


@dataclass(frozen=True)
class Together:
    """Both models on every rank of `world` (one process: `Together(SOLO)`)."""

    world: Collective = SOLO
    holds_policy = True
    holds_critic = True
    overlap = False
    """No early policy pass: the critic's updates run first on the same rank."""
    reports_critic_skips = False
    """Rank 0 holds the critic's engine, whose count the trainer reads."""

    @property
    def group(self) -> Collective:
        """The ranks both engines reduce over: all of them."""
        return self.world

    def work(self, batch: dict[str, Tensor], lr_scale: float, group_size: int = 1) -> list[StepWork]:
        """Every rank's rows (whole GRPO groups on each rank), in rank order; one process takes the batch as it is."""
        if not self.world.distributed:
            return [StepWork(batch, lr_scale)]
        rows = shard_rows(len(batch["input_ids"]), self.world.world, group_size)
        return [StepWork(take_rows(batch, r), lr_scale) for r in rows]

    def exchange(self, rows: dict, whole: dict | None, values: Tensor, metrics: dict, estimate: Estimate):
        """(this rank's advantages, the critic's metrics): the critic ran here, on these rows."""
        return estimate(rows, values, self.world), metrics

    def skipped(self, metrics: dict) -> dict:
        """A skipped step's metrics: this rank counted both engines' skips itself."""
        return metrics


@dataclass(frozen=True)
class Apart:
    """The policy on the first `policy_ranks` of `world`, the critic on the last `critic_ranks`."""

    world: Collective
    """Every rank (the learner's messages)."""
    policy_ranks: int
    critic_ranks: int
    group: Collective
    """This rank's group: the policy's or the critic's."""
    role: str
    """"policy" or "critic"."""
    overlap: bool = True
    """The policy ranks run their first forward pass during the critic's updates (False: after them; the same
    numbers, the placement benchmark's baseline)."""
    reports_critic_skips = True
    """Rank 0 holds no critic engine: the critic ranks send their count with their metrics."""

    @classmethod
    def split(cls, world: Collective, critic_ranks: int, overlap: bool = True) -> Apart:
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
        return cls(world, len(policy), critic_ranks, mine[0] or mine[1], role, overlap)

    @property
    def holds_policy(self) -> bool:
        return self.role == "policy"

    @property
    def holds_critic(self) -> bool:
        return self.role == "critic"

    def work(self, batch: dict[str, Tensor], lr_scale: float, group_size: int = 1) -> list[StepWork]:
        """Rank 0's scatter of one step: every rank's rows, and the whole batch for rank 0."""
        rows = len(batch["input_ids"])
        work = [StepWork(take_rows(batch, r), lr_scale) for r in shard_rows(rows, self.policy_ranks)]
        work += [StepWork(take_rows(batch, r), lr_scale) for r in shard_rows(rows, self.critic_ranks)]
        work[0] = StepWork(work[0].rows, lr_scale, batch)
        return work

    def exchange(self, rows: dict, whole: dict | None, values: Tensor | None, metrics: dict, estimate: Estimate):
        """(this rank's advantages, the critic's metrics on rank 0): a critic rank sends its values and returns
        (None, {}); rank 0 gathers every critic rank's values, estimates the whole batch's advantages and scatters
        each policy rank its rows'."""
        world = self.world
        if self.role == "critic":
            world.gather((values.detach().cpu(), metrics if self.group.is_driver else None))
            world.scatter(None)
            return None, {}
        parts = world.gather(None)
        if not world.is_driver:
            return world.scatter(None).to(rows["rewards"].device), {}
        values = torch.cat([v for v, _ in parts[self.policy_ranks :]]).to(whole["rewards"].device)
        advantages = estimate(whole, values, SOLO)
        split = [advantages[r.start : r.stop] for r in shard_rows(len(advantages), self.policy_ranks)]
        mine = world.scatter(split + [None] * self.critic_ranks)
        return mine.to(rows["rewards"].device), parts[self.policy_ranks][1]

    def skipped(self, metrics: dict) -> dict:
        """A skipped step's metrics, the critic's gathered to rank 0 ({} on the other ranks)."""
        parts = self.world.gather(metrics if self.role == "critic" else None)
        return {**metrics, **parts[self.policy_ranks]} if self.world.is_driver else {}


Placement = Together | Apart

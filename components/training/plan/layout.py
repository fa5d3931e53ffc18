"""Where the models go and what each GPU then holds: one plan per ZeRO stage and critic placement, the cheapest
that fits, and, when none does, how many GPUs or how short the rows would have to be. Numbers in, numbers out
(`planner.py` reads them from a config); the models' bytes come from memory.py, the rest from overheads.py.

A plan fits when its fullest GPU keeps `HEADROOM` of its memory free: the peak counts the models, NCCL, the weight
transfer and a fragmentation reserve, but not the CUDA context, the libraries' workspaces or the estimates' errors.

Placements: `shared` puts the policy and the critic on every rank; `separate` puts the policy on `gpus - c` ranks and
the critic on `c` (`train.critic_ranks`, components/training/rl/placement.py), at ZeRO stages 0-2 (the learner refuses
ZeRO-3 there). Each model's ranks split the batch evenly. A separate plan is the split whose fuller GPU holds the
least.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from components.training.plan.memory import (
    Decoder,
    ModelMemory,
    Params,
    Zero,
    gpu_peak,
    micro_batch_tokens,
    model_memory,
)
from components.training.plan.overheads import Runtime, fragmentation_share, nccl_group_bytes, transfer_bytes

Placement = Literal["shared", "separate"]
PLACEMENTS: tuple[Placement, ...] = ("shared", "separate")
MAX_GPUS = 1024
"""`fewest_gpus` looks no further."""
HEADROOM = 0.10
"""The share of a GPU's memory a plan must leave free to fit (module docstring)."""


@dataclass(frozen=True)
class Workload:
    """The numbers a plan reads from a config."""

    policy: Params
    """The policy's parameters."""
    critic: Params | None
    """The critic's (its frozen attention counted as not trainable); None: the algorithm trains none."""
    decoder: Decoder
    """The sizes the activations depend on (the critic shares the policy's decoder)."""
    zero: Zero
    """The DeepSpeed settings; a plan replaces the stage."""
    batch_size: int
    """Trajectories per step (`train.batch_size`), split evenly over a model's ranks."""
    longest: int
    """Tokens in the longest row (`rollout.max_total_tokens`)."""
    budget: int
    """Padded tokens per micro-batch (`train.micro_batch_tokens`); 0: a rank's whole share in one pass."""
    checkpointing: bool
    """Activation checkpointing (`train.activation_checkpointing`)."""
    runtime: Runtime = Runtime()
    """The weight transfer and the allocator (overheads.py); the default has no transfer and no expandable segments."""


@dataclass(frozen=True)
class GpuMemory:
    """One kind of GPU of a plan: the models it trains and what it holds besides them (overheads.py)."""

    holds: str
    """Which models: policy, critic or policy+critic."""
    models: tuple[ModelMemory, ...]
    """Their bytes on this GPU."""
    groups: tuple[int, ...]
    """Ranks of each NCCL communicator this GPU is in."""
    transfer: float
    """The weight transfer's buckets on this GPU (the policy's first rank; 0 elsewhere)."""
    expandable: bool
    """The allocator's segments grow in place (a smaller fragmentation reserve)."""

    @property
    def nccl(self) -> float:
        """NCCL's buffers, every communicator's."""
        return float(sum(nccl_group_bytes(ranks) for ranks in self.groups))

    @property
    def allocated(self) -> float:
        """The caching allocator's peak: the models' (memory.py `gpu_peak`) and the transfer's buckets on top
        (overheads.py: during the next step with `rollout.publish_overlap`, an upper bound without)."""
        return gpu_peak(list(self.models)) + self.transfer

    @property
    def fragmentation(self) -> float:
        """The reserve for the allocator's fragmentation, a share of its bytes."""
        return fragmentation_share(self.expandable) * self.allocated

    @property
    def peak(self) -> float:
        """Everything: the allocator's peak, its fragmentation reserve, NCCL's buffers."""
        return self.allocated + self.fragmentation + self.nccl

    @property
    def host(self) -> float:
        """Host memory the models' offloaded optimizers take per GPU (not counted in the peak)."""
        return sum(m.host for m in self.models)


@dataclass(frozen=True)
class GpuPlan:
    """One ZeRO stage and placement of a workload on `gpus` GPUs."""

    stage: int
    """ZeRO stage."""
    placement: Placement
    """shared or separate (module docstring)."""
    policy_ranks: int
    """GPUs that hold the policy."""
    critic_ranks: int
    """GPUs that hold the critic (all of them when shared; 0 without a critic)."""
    policy: ModelMemory
    """The policy's bytes on each of its GPUs."""
    critic: ModelMemory | None
    """The critic's bytes on each of its GPUs."""
    tokens: int
    """Padded tokens in the policy's largest micro-batch."""
    capacity: float
    """Bytes one GPU has for training."""
    runtime: Runtime
    """The weight transfer and the allocator."""
    transfer: float
    """The weight transfer's buckets on the policy's first GPU (0 without a collective transfer)."""

    @property
    def gpus(self) -> int:
        """GPUs in all."""
        return self.policy_ranks + (self.critic_ranks if self.placement == "separate" else 0)

    @property
    def per_model(self) -> int:
        """The most GPUs one model spans (the first sort key of `cheapest`)."""
        return max(self.policy_ranks, self.critic_ranks)

    @property
    def kinds(self) -> list[GpuMemory]:
        """The kinds of GPU: one when shared, two when separate. Each is in torchrun's world group and in the group
        its model's DeepSpeed engine reduces over (a clone of the world when shared); the policy's kind is the one
        with rank 0, which also holds the transfer's buckets and a group with each server (overheads.py)."""
        pairs = (2,) * self.runtime.transfer_servers
        expandable = self.runtime.expandable_segments

        def kind(holds: str, models: list[ModelMemory], ranks: int, first: bool) -> GpuMemory:
            groups = (self.gpus, ranks, *(pairs if first else ()))
            return GpuMemory(holds, tuple(models), groups, self.transfer if first else 0.0, expandable)

        if self.critic is None:
            return [kind("policy", [self.policy], self.policy_ranks, True)]
        if self.placement == "shared":
            return [kind("policy+critic", [self.policy, self.critic], self.gpus, True)]
        return [
            kind("policy", [self.policy], self.policy_ranks, True),
            kind("critic", [self.critic], self.critic_ranks, False),
        ]

    @property
    def fullest(self) -> GpuMemory:
        """The kind of GPU whose peak is highest."""
        return max(self.kinds, key=lambda kind: kind.peak)

    @property
    def peak(self) -> float:
        """Peak bytes of the fullest GPU."""
        return self.fullest.peak

    @property
    def free(self) -> float:
        """Bytes the fullest GPU leaves free (negative: what it lacks)."""
        return self.capacity - self.peak

    @property
    def fits(self) -> bool:
        """The fullest GPU keeps `HEADROOM` of its capacity free."""
        return self.free >= HEADROOM * self.capacity


def plan(w: Workload, gpus: int, stage: int, placement: Placement, capacity: float, critic_ranks: int = 0) -> GpuPlan:
    """`w` at ZeRO `stage` on `gpus` GPUs: shared, or separate with the critic on `critic_ranks` of them."""
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {gpus}")
    if placement == "separate" and w.critic is None:
        raise ValueError("placement: separate places a critic, and this algorithm trains none")
    if placement == "separate" and not 0 < critic_ranks < gpus:
        raise ValueError(f"critic ranks: a separate critic needs 1 to {gpus - 1} of {gpus} GPUs, got {critic_ranks}")
    zero = dataclasses.replace(w.zero, stage=stage)
    policy_ranks = gpus - critic_ranks if placement == "separate" else gpus
    c_ranks = (critic_ranks if placement == "separate" else gpus) if w.critic is not None else 0

    def on(params: Params, ranks: int, lm_head: bool) -> tuple[ModelMemory, int]:
        tokens = micro_batch_tokens(w.batch_size, ranks, w.longest, w.budget)
        memory = model_memory(params, w.decoder, ranks, zero, tokens, w.longest, w.checkpointing, lm_head)
        return memory, tokens

    policy, tokens = on(w.policy, policy_ranks, lm_head=True)
    critic = on(w.critic, c_ranks, lm_head=False)[0] if w.critic is not None else None
    low = 2 if zero.bf16 else 4
    transfer = transfer_bytes(w.runtime.transfer_servers, w.runtime.transfer_bucket, low * w.policy.largest_param)
    return GpuPlan(stage, placement, policy_ranks, c_ranks, policy, critic, tokens, capacity, w.runtime, transfer)


def plans(w: Workload, gpus: int, capacity: float, placements: tuple[Placement, ...] = PLACEMENTS) -> list[GpuPlan]:
    """Every ZeRO stage, shared and (with a critic and two GPUs or more) separate at its best split."""
    rows = []
    for stage in range(4):
        if "shared" in placements:
            rows.append(plan(w, gpus, stage, "shared", capacity))
        if "separate" in placements and w.critic is not None and gpus >= 2 and stage < 3:
            splits = [plan(w, gpus, stage, "separate", capacity, c) for c in range(1, gpus)]
            rows.append(min(splits, key=lambda p: (p.peak, p.critic_ranks)))
    return rows


def cheapest(rows: list[GpuPlan]) -> GpuPlan | None:
    """The plan that fits with the fewest GPUs per model, then the lowest ZeRO stage; None when none fits."""
    fitting = [p for p in rows if p.fits]
    return min(fitting, key=lambda p: (p.per_model, p.stage, p.placement != "shared")) if fitting else None


def fewest_gpus(w: Workload, capacity: float, start: int, placement: Placement) -> GpuPlan | None:
    """The cheapest fitting plan with `placement` on the fewest GPUs from `start`; None up to MAX_GPUS. More GPUs
    hold less (states shrink, a micro-batch never grows; NCCL's NVLS buffers from three GPUs on are far smaller than
    the states the third GPU takes off the others), so a bisection finds it."""

    def best(gpus: int) -> GpuPlan | None:
        return cheapest(plans(w, gpus, capacity, (placement,)))

    if start > MAX_GPUS or best(MAX_GPUS) is None:
        return None
    low, high = start, MAX_GPUS  # best(high) fits
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if best(mid) is not None else (mid + 1, high)
    return best(low)


def longest_rows(w: Workload, gpus: int, capacity: float, step: int = 1024) -> int:
    """The longest rows (a multiple of `step`, at most `w.longest`) with which some plan fits on `gpus` GPUs, each
    micro-batch one row's worth of tokens; 0 when not even `step` does."""

    def fits(longest: int) -> bool:
        return cheapest(plans(dataclasses.replace(w, longest=longest, budget=longest), gpus, capacity)) is not None

    low, high = 0, w.longest // step  # fits(low * step) holds (0: nothing), fits(high * step + ...) is unknown
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid - 1)
    return low * step

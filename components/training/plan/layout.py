"""Where the models go and what each GPU then holds: one plan per ZeRO stage and critic placement, the cheapest
that fits, and, when none does, how many GPUs or how short the rows would have to be. Numbers in, numbers out
(`planner.py` reads them from a config); the bytes come from memory.py.

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

Placement = Literal["shared", "separate"]
PLACEMENTS: tuple[Placement, ...] = ("shared", "separate")
MAX_GPUS = 1024
"""`fewest_gpus` looks no further."""


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

    @property
    def gpus(self) -> int:
        """GPUs in all."""
        return self.policy_ranks + (self.critic_ranks if self.placement == "separate" else 0)

    @property
    def per_model(self) -> int:
        """The most GPUs one model spans (the first sort key of `cheapest`)."""
        return max(self.policy_ranks, self.critic_ranks)

    @property
    def kinds(self) -> list[tuple[str, list[ModelMemory]]]:
        """The kinds of GPU, each with the models it holds: one kind when shared, two when separate."""
        if self.critic is None:
            return [("policy", [self.policy])]
        if self.placement == "shared":
            return [("policy+critic", [self.policy, self.critic])]
        return [("policy", [self.policy]), ("critic", [self.critic])]

    @property
    def fullest(self) -> tuple[str, list[ModelMemory]]:
        """The kind of GPU whose peak is highest."""
        return max(self.kinds, key=lambda kind: gpu_peak(kind[1]))

    @property
    def peak(self) -> float:
        """Peak bytes of the fullest GPU."""
        return gpu_peak(self.fullest[1])

    @property
    def fits(self) -> bool:
        """The fullest GPU's peak is within its capacity."""
        return self.peak <= self.capacity


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
    return GpuPlan(stage, placement, policy_ranks, c_ranks, policy, critic, tokens, capacity)


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
    never hold more (states shrink, a micro-batch never grows), so a bisection finds it."""

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

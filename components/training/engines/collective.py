"""Data parallelism for the trainer step: what the ranks exchange, and how a batch is split among them.

Under torchrun, rank 0 runs the agent loop and splits every batch by rows (whole GRPO groups stay on one
rank); every rank runs the same algorithm step on its rows, and DeepSpeed averages the gradients. The step
stays exact, not merely close, because every token-mean is taken over the *global* token count:

- each rank scales its local loss `S_r / n_r` by `share_r = n_r * W / N` (N = tokens on all ranks), so the
  averaged gradient is `sum_r grad S_r / N`, the single-process gradient of the whole batch;
- advantage whitening and explained variance use global moments (sums of x, x^2 and counts);
- the running-mean baseline sees every rank's rewards in rank order;
- reported metrics are token-weighted over ranks, so they equal the single-process values.

`SOLO` (world size 1) is the identity, so single-process code paths compute exactly what they did before.

Devices: on GPUs the process group carries two backends (`cpu:gloo,cuda:nccl`, `init_process_group`): tensor
reductions go over NCCL when the tensor lives on a GPU and over gloo when it lives on the host, and object
messages (pickled batches, the learner's commands) always go over gloo, on the host. Tensors that travel as
objects are moved to the host first, so no rank ever unpickles another rank's GPU tensor.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Collective:
    rank: int = 0
    """This process's rank in `group`."""
    world: int = 1
    """Ranks in `group`."""
    group: object = None
    """The process group (None: every rank). The critic on ranks of its own (`train.critic_ranks`) reduces over its
    group, the policy over the rest; the learner's messages always go to every rank."""

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_driver(self) -> bool:
        """This rank is its group's first (rank 0 of the world: the driver, `is_driver()`)."""
        return self.rank == DRIVER

    def sum(self, x: Tensor) -> Tensor:
        """All-reduce sum (a new tensor; the input is untouched)."""
        if not self.distributed:
            return x

        out = x.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out

    def max(self, x: Tensor) -> Tensor:
        """All-reduce max (a new tensor; the input is untouched)."""
        if not self.distributed:
            return x

        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def gather_rows(self, x: Tensor) -> tuple[Tensor, int]:
        """Every rank's rows concatenated in rank order (on `x`'s device), and where this rank's rows start."""
        if not self.distributed:
            return x, 0

        parts: list = [None] * self.world
        dist.all_gather_object(parts, x.detach().cpu(), group=self.group)
        offset = sum(len(p) for p in parts[: self.rank])
        return torch.cat(parts).to(x.device), offset

    def scatter(self, items: list | None) -> object:
        """Rank 0 passes one item per rank and gets its own back; the other ranks pass None."""
        if not self.distributed:
            return items[0]

        out: list = [None]
        dist.scatter_object_list(out, items if self.rank == 0 else None, src=0)
        return out[0]

    def gather(self, item: object) -> list | None:
        """Every rank's item, in rank order, on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [item]

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(item, out, dst=0)
        return out

    def broadcast(self, item: object) -> object:
        """Rank 0's item on every rank."""
        if not self.distributed:
            return item

        box = [item]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_true(self, flag: bool) -> bool:
        """True only if `flag` is true on every rank (ranks must agree to skip an update together)."""
        if not self.distributed:
            return flag
        return bool(self.sum(torch.tensor([0 if flag else 1])).item() == 0)


SOLO = Collective()


def from_environment() -> Collective:
    """The torch.distributed world when one is initialised with more than one rank, else `SOLO`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Collective(dist.get_rank(), dist.get_world_size())
    return SOLO


def subgroup(ranks: list[int]) -> Collective | None:
    """A `Collective` over `ranks` for the ranks among them (None for the others). Every rank must call it, with the
    same `ranks`, in the same order (torch creates groups collectively)."""
    group = dist.new_group(ranks)
    rank = dist.get_rank()
    return Collective(ranks.index(rank), len(ranks), group) if rank in ranks else None


DRIVER = 0
"""The rank that drives a run: it runs the stage (the flow, the agent loop, the evaluation) and tells the other
ranks what to do (components/stages/ranks.py says what they do in each stage)."""


def launched_rank() -> int:
    """RANK set by torchrun (0 when not launched by it): the one place the environment's rank is read."""
    return int(os.environ.get("RANK", "0"))


def is_driver() -> bool:
    """True in the process that drives a run: the only one, or rank 0 under torchrun."""
    return launched_rank() == DRIVER


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes of this run on this machine (LOCAL_WORLD_SIZE set by torchrun; 1 when not launched by it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def rank_cores() -> int:
    """This rank's share of the machine's cores (those this process may run on, split among the run's processes on
    this machine): torch's thread count is per process, and ranks that each took every core would fight for them."""
    return max(1, len(os.sched_getaffinity(0)) // local_world_size())


def local_device() -> torch.device:
    """This rank's device: its GPU (`cuda:LOCAL_RANK`) when torch sees GPUs and DeepSpeed is not told to use the
    CPU (`DS_ACCELERATOR=cpu`), else the host."""
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """`init_process_group`'s backend for ranks on `device`: gloo on the host; on GPUs gloo for host tensors and
    object messages beside NCCL for GPU tensors (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def end_rank_process() -> NoReturn:
    """End a rank's process once its part of a run has returned: flush, then `os._exit(0)`. The interpreter's own
    teardown can abort in C++ when gloo or DeepSpeed threads are still joinable ("terminate called without an
    active exception", SIGABRT), which torchrun reports as the job failing although every rank's work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard_rows(rows: int, world: int, group_size: int = 1) -> list[range]:
    """Contiguous row ranges, one per rank, as even as whole groups of `group_size` allow."""
    if rows % group_size:
        raise ValueError(f"rows: {rows} is not a multiple of group_size={group_size}")
    groups = rows // group_size
    if groups < world:
        raise ValueError(f"batch: {groups} group(s) cannot be split over {world} ranks")
    bounds = [group_size * (groups * r // world) for r in range(world + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(world)]


def take_rows(batch: dict[str, Tensor], rows: range) -> dict[str, Tensor]:
    return {k: v[rows.start : rows.stop] for k, v in batch.items()}


def global_moments(x: Tensor, mask: Tensor, comm: Collective) -> tuple[Tensor, Tensor]:
    """(mean, population variance) of `x` over the masked positions of every rank; (0, 0) when empty.
    Two passes, as `masked_var`: with one rank it returns exactly `masked_mean` and `masked_var`."""
    m = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    sums = comm.sum(torch.stack([torch.where(m, x, zero).sum(), m.sum().to(x.dtype)]))
    count = sums[1].clamp(min=1)
    mean = sums[0] / count
    centred = torch.where(m, x - mean, zero)
    return mean, comm.sum((centred * centred).sum()) / count

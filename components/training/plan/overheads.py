"""What a training GPU holds besides the models' tensors (memory.py): NCCL's communicators, the collective weight
transfer's buckets, and the caching allocator's fragmentation. Each is an estimate with its source, in bytes; a
GPU's own measurement (bench/gpu_check.py) is what should replace it.

NCCL, per communicator and rank. NCCL gives every connection to a peer, on every channel, one FIFO per protocol: LL
512 KiB (8 lines x 512 threads x 8 steps x 16 B), LL128 4,800 KiB (120 x 640 x 8 x 8 B) and Simple `NCCL_BUFFSIZE`,
4 MiB by default (NCCL's src/init.cc: DEFAULT_LL_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_BUFFSIZE). That is 9.19 MiB,
mapped as 10 MiB at NCCL's 2 MiB granularity (the 10,485,760-byte allocations in the ALLOC log of NVIDIA/nccl#1685).
A ring gives each rank two connections per channel (from its predecessor, to its successor; a two-member group too),
and NCCL opens up to 32 channels on an NVLink-4 node (MAXCHANNELS; #1685 saw 32 between 8 H100s): 32 x 2 x 10 MiB =
640 MiB. A communicator of more than two GPUs behind an NVSwitch (H100, H200) also sets up NVLink SHARP buffers:
288 MiB per rank on 8 H200s (`nvlsPerRankSize 301989888`, vllm-project/vllm#9699; `NCCL_NVLS_ENABLE=0` drops them).
Measured on 4 A100s (fewer channels, no NVLS): 544 MB per two-GPU group, 688 MB per larger one (NVIDIA/nccl#964), the
same order. Tree connections come on top of the ring's, so this is an estimate, not a bound; a group of one rank has
no peer and holds nothing.

Which communicators a rank holds: torchrun's world group (the learner reduces GPU tensors over NCCL,
components/training/engines/collective.py) and the group DeepSpeed reduces over: its clone of the world group when
the models share the ranks (deepspeed/utils/groups.py `_clone_world_group`), else the model's own group
(components/training/engines/engine.py `GroupMPU`, whose one-rank model-parallel group has no peer). The policy's
first rank also holds a group with each server's workers for the collective transfer
(`rollout.weight_transfer = "collective"`, components/rollout/transfer.py `pair_group`); those peers are across the
network, where NCCL opens fewer channels and may keep the Simple FIFO in host memory, so 640 MiB each is high.

The weight transfer, on the policy's first rank: a version is packed into host buckets of `rollout.transfer_bucket_mb`
(pinned, components/rollout/transports.py `stage`) and each bucket is copied to the GPU to be broadcast
(transfer.py `Sender.send`); a tensor larger than a bucket goes alone. Every server gets its copy at the same time
(components/rollout/pool.py `publish` gathers one send per server), so the planner counts two buckets on the GPU per
server (the one on the wire and the next copied in), each at least the largest single parameter. With
`rollout.publish_overlap` the transfer runs during the next training step, so its buckets add to the step's peak.
Without, it runs between steps; the planner adds them all the same, an upper bound (the allocator may hand their
blocks to the next step). The staged host copies (two versions, transports.py `KEEP_STAGED`) are host memory.

Fragmentation: PyTorch's caching allocator keeps freed blocks in the segments it took from cudaMalloc; a request
that no free block fits takes a new segment even when the free bytes would do, so the memory reserved runs above the
bytes allocated, the more as tensor sizes vary (variable-length micro-batches do). Without expandable segments the
planner reserves 10% of the allocator's bytes: an RL trainer on 8 B200s ran out of memory with about 20 of 183 GiB
reserved but unallocated (NovaSky-AI/SkyRL#1768, 11%); the ZeRO paper ran out with over 30% free on its largest
models (Rajbhandari et al. 2020, section 3.2). With `expandable_segments:True` a segment grows in place by mapping
pages (pytorch/pytorch#96995), so what remains is holes between live blocks: 3%, the order of the 2.4% a 70B model's
load left reserved but unallocated (vllm-project/compressed-tensors#587).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

NCCL_CONNECTION = 10 * 2**20
"""Bytes of one connection's FIFOs on one channel: LL, LL128 and Simple, 9.19 MiB mapped as 10 MiB (docstring)."""
NCCL_CHANNELS = 32
"""Channels NCCL opens at most (MAXCHANNELS), which it does between GPUs on NVLink 4."""
NCCL_RING_CONNECTIONS = 2
"""A ring's connections per channel and rank: from the predecessor, to the successor."""
NCCL_NVLS = 301_989_888
"""NVLink SHARP buffers per rank of a communicator of more than two GPUs on an NVSwitch (vLLM #9699, 8 H200s)."""
FRAGMENTATION = 0.10
"""The share of the allocator's bytes held in reserve for fragmentation without expandable segments (docstring)."""
FRAGMENTATION_EXPANDABLE = 0.03
"""The same with `expandable_segments:True`."""
TRANSFER_BUCKETS_ON_GPU = 2
"""Transfer buckets on the sending GPU at once per server: the one being broadcast and the next copied in."""


@dataclass(frozen=True)
class Runtime:
    """What the overheads depend on besides the models: the weight transfer (from the config) and the allocator
    (from the environment)."""

    transfer_servers: int = 0
    """Servers the policy's first rank sends each version to over NCCL (`rollout.urls` with
    `rollout.weight_transfer = "collective"`); 0: no collective transfer."""
    transfer_bucket: int = 0
    """Bytes of one transfer bucket (`rollout.transfer_bucket_mb` MiB)."""
    publish_overlap: bool = False
    """The transfer runs during the next training step (`rollout.publish_overlap`)."""
    expandable_segments: bool = False
    """The allocator grows its segments in place (`expandable_segments:True` where the ranks start)."""

    def __post_init__(self) -> None:
        if self.transfer_servers and self.transfer_bucket <= 0:
            raise ValueError(f"rollout.transfer_bucket_mb: must be > 0, got {self.transfer_bucket} bytes")


def nccl_group_bytes(ranks: int) -> int:
    """One rank's bytes of an NCCL communicator of `ranks` GPUs (docstring): the ring's FIFOs on every channel, and
    NVLink SHARP's buffers when there are more than two."""
    if ranks < 1:
        raise ValueError(f"ranks: a communicator has at least one rank, got {ranks}")
    if ranks == 1:
        return 0
    return NCCL_CHANNELS * NCCL_RING_CONNECTIONS * NCCL_CONNECTION + (NCCL_NVLS if ranks > 2 else 0)


def transfer_bytes(servers: int, bucket: int, largest_tensor: float) -> float:
    """The sending GPU's transfer buckets (docstring): two per server, each the bucket size or the largest tensor
    (bytes), whichever is larger."""
    return float(servers * TRANSFER_BUCKETS_ON_GPU * max(bucket, largest_tensor))


def fragmentation_share(expandable: bool) -> float:
    """The share of the allocator's bytes held for fragmentation (docstring)."""
    return FRAGMENTATION_EXPANDABLE if expandable else FRAGMENTATION


def expandable_segments(environ: Mapping[str, str]) -> bool:
    """Whether `environ` turns the allocator's expandable segments on: `expandable_segments:True` in
    PYTORCH_ALLOC_CONF, else in its older name PYTORCH_CUDA_ALLOC_CONF (torch reads the option as True or False)."""
    conf = environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    options = dict(item.split(":", 1) for item in conf.split(",") if ":" in item)
    return options.get("expandable_segments", "").strip() == "True"

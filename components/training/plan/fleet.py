"""The rollout side of `sao plan`: what a vLLM server holds, how fast it samples, how many rollout GPUs keep the
trainer fed at a preset's batch and lengths, and how long a weight sync takes by the configured path. Every figure
is arithmetic on the model's sizes and a few stated assumptions (the constants below), printed with its terms, so a
reader can redo it; a GPU's own measurement replaces an assumption where one exists (docs/gpu.md).

Sampling is memory-bound: each decode step of a server reads the weights its sequences route to (with many
sequences, every expert of an MoE layer) and every sequence's KV cache, so a step takes (weights read + KV read) /
(HBM bandwidth x `HBM_EFFICIENCY`), and it advances every sequence in flight by one token; a step cannot be faster
than its FLOPs at `DECODE_MFU`. How many sequences a server holds is its KV cache (vLLM's `GPU_UTILIZATION` of the
memory less the weights) over the average context, `CONTEXT_SHARE` of a trajectory's length, at most `MAX_SEQS`.

Training is compute-bound: a step's FLOPs (the policy's forward, recomputation and backward, the critic's K updates
and its values, attention over the average context) over the training GPUs at `TRAIN_MFU`. SAO's trainer consumes
a step's trajectories while the servers sample the next, so the rollout GPUs keep it fed when they sample a step's
tokens in one training step's time.

A weight sync moves the policy's bf16 weights from the trainer to every server. With `rollout.transfer_senders =
"rank0"` one rank sends (components/rollout/transfer.py: the policy's rank 0 gathers the whole policy, ZeRO-3's shards
over the trainer's links, then sends every server its copy through its own link); with "all" every policy rank sends
its share of the buckets (components/rollout/senders.py), dividing the sender's part by the number of ranks and
leaving each server's own link as the bound. A tensor-parallel server's workers each receive the whole version
through their own links, in parallel, so the bound is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from components.config import Config
from components.training.plan.memory import Decoder, Params
from components.training.rl.algorithms import ALGORITHMS

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: float
    """Bytes."""
    hbm: float
    """Peak memory bandwidth, bytes/s."""
    flops: float
    """Dense bf16 peak, FLOP/s."""


H100 = Gpu("H100 SXM", 80e9, 3.35e12, 989e12)
"""NVIDIA's H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16."""
H200 = Gpu("H200", 141e9, 4.8e12, 989e12)
"""NVIDIA's H200 datasheet: 141 GB HBM3e at 4.8 TB/s, the H100's compute."""
NVLINK = 450e9
"""Bytes/s one GPU sends over NVLink 4 (900 GB/s both ways): a gather within one node."""
POD_TCP = 2e9
"""Bytes/s of NCCL's socket transport over a pod network (infra/k8s/vllm.yaml's sao-nccl: NCCL_IB_DISABLE=1;
1-3 GB/s, docs/gpu.md section 7)."""

GPU_UTILIZATION = 0.9
"""vLLM's default --gpu-memory-utilization: the share of a GPU's memory a server takes for weights and KV cache."""
MAX_SEQS = 256
"""vLLM's default --max-num-seqs: sequences a server decodes at once."""
CONTEXT_SHARE = 0.5
"""A sequence's average context while it decodes, as a share of its final length (it grows from 0 to all)."""
HBM_EFFICIENCY = 0.7
"""The share of peak bandwidth a decode step's reads reach (an assumption; decode kernels reach 60-80%)."""
DECODE_MFU = 0.5
"""The share of peak FLOP/s a decode step's matrix products reach when they, not the reads, bound it."""
TRAIN_MFU = 0.25
"""The share of peak FLOP/s a training step reaches (an assumption for an MoE under ZeRO-3: 20-30% is usual)."""
WEIGHT_BYTES = 2
"""bf16: the servers' weights, the KV cache and what a sync sends, per element."""


@dataclass(frozen=True)
class Fleet:
    """The rollout side's figures (bytes, seconds, tokens)."""

    gpu: Gpu
    tensor_parallel: int
    weights: float
    """A server's weights, on each of its GPUs (split by tensor parallelism)."""
    kv_per_token: float
    kv_tokens: float
    """Tokens of KV cache a server holds."""
    context: float
    sequences: int
    """Sequences a server decodes at once."""
    read: float
    """Bytes a decode step reads, per GPU of a server."""
    step: float
    """Seconds of one decode step."""
    compute_bound: bool
    tokens_per_s: float
    """Tokens a server samples per second."""
    step_tokens: float
    """Tokens of one training step's trajectories."""
    train_flops: float
    train_s: float
    gpus_needed: int
    """Rollout GPUs that sample a step's tokens in one training step's time."""
    configured_gpus: int


def expert_params(d: Decoder) -> tuple[int, int]:
    """(every expert's parameters, those one token uses): gate, up and down projections of width f per expert."""
    per_expert = 3 * d.hidden * d.intermediate
    if not d.experts:
        return 0, 0
    return d.layers * d.experts * per_expert, d.layers * d.top_k * per_expert


def kv_bytes_per_token(d: Decoder) -> int:
    """Keys and values of every layer for one token: 2 x layers x KV heads x head width x 2 bytes."""
    return 2 * d.layers * d.kv_heads * d.head_dim * WEIGHT_BYTES


def experts_touched(d: Decoder, sequences: int) -> float:
    """Expected experts a decode step reads per layer when `sequences` tokens each pick top_k of E uniformly."""
    if not d.experts:
        return 0.0
    return d.experts * (1 - (1 - d.top_k / d.experts) ** sequences)


def plan_fleet(cfg: Config, policy: Params, d: Decoder, gpu: Gpu, train_gpus: int, mean_tokens: int) -> Fleet:
    total_experts, active_experts = expert_params(d)
    dense = policy.total - total_experts
    active = dense + active_experts
    usable = GPU_UTILIZATION * gpu.memory
    tensor_parallel = 1
    while policy.total * WEIGHT_BYTES / tensor_parallel > 0.6 * usable:  # leave a KV cache worth having
        tensor_parallel *= 2
    weights = policy.total * WEIGHT_BYTES / tensor_parallel
    kv_token = kv_bytes_per_token(d) / tensor_parallel
    kv_tokens = (usable - weights) / kv_token
    context = CONTEXT_SHARE * mean_tokens
    sequences = max(1, min(MAX_SEQS, int(kv_tokens // context)))
    expert_share = experts_touched(d, sequences) / d.experts if d.experts else 0.0
    read = (dense + expert_share * total_experts) * WEIGHT_BYTES / tensor_parallel + sequences * context * kv_token
    memory_s = read / (gpu.hbm * HBM_EFFICIENCY)
    compute_s = 2 * active * sequences / tensor_parallel / (gpu.flops * DECODE_MFU)
    step = max(memory_s, compute_s)
    step_tokens = cfg.train.batch_size * mean_tokens
    passes = 8 if cfg.train.activation_checkpointing else 6  # forward, (recompute,) backward = 2x forward
    attention = 4 * d.layers * d.heads * d.head_dim * context  # QK^T and AV over the average context, forward
    policy_flops = passes * active + passes // 2 * attention
    critic = (
        cfg.algo.critic_updates * policy_flops + 2 * active + attention if ALGORITHMS[cfg.train.algo].uses_critic else 0
    )
    train_flops = step_tokens * (policy_flops + critic)
    train_s = train_flops / (train_gpus * gpu.flops * TRAIN_MFU)
    per_gpu = sequences / step / tensor_parallel
    return Fleet(
        gpu=gpu,
        tensor_parallel=tensor_parallel,
        weights=weights,
        kv_per_token=kv_token,
        kv_tokens=kv_tokens,
        context=context,
        sequences=sequences,
        read=read,
        step=step,
        compute_bound=compute_s > memory_s,
        tokens_per_s=sequences / step,
        step_tokens=step_tokens,
        train_flops=train_flops,
        train_s=train_s,
        gpus_needed=math.ceil(step_tokens / (per_gpu * train_s)),
        configured_gpus=len(cfg.rollout.urls) * tensor_parallel,
    )


def fleet_lines(
    cfg: Config, f: Fleet, policy: Params, d: Decoder, gpu: Gpu, nodes: int, gpus: int, mean_tokens: int
) -> list:
    """The rollout side's report of `f` (`plan_fleet`'s): the server, its sampling rate, the GPUs that keep `nodes` x
    `gpus` training GPUs fed, each figure with its arithmetic."""
    tp = f.tensor_parallel
    per = f" per GPU of {tp}" if tp > 1 else ""
    bound = "compute" if f.compute_bound else f"reads / ({gpu.hbm / 1e12:g} TB/s x {HBM_EFFICIENCY:.0%})"
    lines = [
        f"rollout side ({gpu.name}: {gpu.memory / GB:g} GB, {gpu.hbm / 1e12:g} TB/s; a vLLM server on {tp} GPU(s)):",
        f"  a server holds   weights {f.weights / GB:.1f} GB{per} ({_n(policy.total)} x {WEIGHT_BYTES} bytes"
        + (f" / {tp}" if tp > 1 else "")
        + f"), KV cache {(GPU_UTILIZATION * gpu.memory - f.weights) / GB:.1f} GB ({GPU_UTILIZATION:.0%} of the GPU "
        f"less the weights) = {f.kv_tokens:,.0f} tokens of {f.kv_per_token:,.0f} bytes (2 x {d.layers} layers x "
        f"{d.kv_heads} KV heads x {d.head_dim} x {WEIGHT_BYTES} bytes" + (f" / {tp}" if tp > 1 else "") + ")",
        f"  in flight        {f.sequences} sequences per server = min({MAX_SEQS}, KV tokens / {f.context:,.0f}, the "
        f"average context: {CONTEXT_SHARE:.0%} of {mean_tokens:,} mean tokens per trajectory)",
        f"  a decode step    {f.step * 1e3:.1f} ms = {bound}, reads {f.read / GB:.1f} GB{per} (the weights the "
        f"sequences route to"
        + (f": {experts_touched(d, f.sequences):.1f} of {d.experts} experts per layer" if d.experts else "")
        + ", and their KV cache)",
        f"  sampling         {f.tokens_per_s:,.0f} tokens/s per server = {f.sequences} sequences / {f.step * 1e3:.1f} ms",
        f"trainer side: a step is {f.step_tokens:,.0f} tokens ({cfg.train.batch_size} trajectories x {mean_tokens:,}), "
        f"{f.train_flops:.3g} FLOPs, {f.train_s:.1f} s on {nodes} x {gpus} GPUs at {TRAIN_MFU:.0%} of "
        f"{gpu.flops / 1e12:g} TFLOP/s",
        f"  rollout GPUs that keep it fed: {f.gpus_needed} = {f.step_tokens:,.0f} tokens / "
        f"({f.tokens_per_s / tp:,.0f} tokens/s per GPU x {f.train_s:.1f} s), "
        f"{math.ceil(f.gpus_needed / tp)} server(s) of {tp} GPU(s), rollout.concurrency >= "
        f"{math.ceil(f.gpus_needed / tp) * f.sequences:,}",
    ]
    have = f.configured_gpus
    if have < f.gpus_needed:
        sample_s = f.step_tokens / (f.tokens_per_s / tp * have)
        lines.append(
            f"  configured: {len(cfg.rollout.urls)} server(s) (rollout.urls) sample a step in {sample_s:.0f} s: the "
            f"trainer waits {1 - f.train_s / sample_s:.0%} of the time"
        )
    else:
        lines.append(f"  configured: {len(cfg.rollout.urls)} server(s) (rollout.urls): enough")
    return lines


def sync_lines(cfg: Config, policy: Params, nodes: int, gpus: int, link: float, servers: int) -> list[str]:
    """The weight sync by the configured path: bytes, senders, links, with the arithmetic; whether it stays under
    `SYNC_TARGET_S`, else the link that makes it impossible."""
    version = policy.total * WEIGHT_BYTES
    if cfg.rollout.weight_transfer != "collective":
        return [
            f"weight sync ({cfg.rollout.weight_transfer}): {version / GB:.1f} GB per version through the shared "
            "volume; bounded by its bandwidth, not planned here"
        ]
    world = nodes * gpus
    between = link if nodes > 1 else NVLINK
    gather = version * (world - 1) / world / between
    where = f"{link / GB:g} GB/s between nodes (--link-gb-s)" if nodes > 1 else f"NVLink, {NVLINK / GB:g} GB/s"
    every = cfg.rollout.transfer_senders == "all"
    senders = max(world - cfg.train.critic_ranks, 1) if every else 1
    size = f"{version / GB:.1f} GB"
    if senders == 1:
        send = servers * version / link
        how = f"{servers} x {size} through the sender's {link / GB:g} GB/s link"
        who = "1 sender (the policy's rank 0)"
    else:
        send = max(servers * version / senders / link, version / link)
        how = f"max({servers} x {size} / {senders} senders, {size} into each server) / {link / GB:g} GB/s links"
        who = f'{senders} senders (every policy rank: rollout.transfer_senders = "all")'
    total = gather + send
    lines = [
        f"weight sync (collective, NCCL): {size} per version ({_n(policy.total)} x {WEIGHT_BYTES} "
        f"bytes) to {servers} server(s), from {who}:",
        f"  gather  {gather:.1f} s = {size} x {world - 1}/{world} (ZeRO-3's shards) / {where}",
        f"  send    {send:.1f} s = {how}",
        f"  total   {total:.2f} s" + (f": under {SYNC_TARGET_S:g} s" if total <= SYNC_TARGET_S else ""),
    ]
    if total > SYNC_TARGET_S and senders == 1:
        spread = max(servers * version / world / link, version / link)
        lines.append(
            f"  over {SYNC_TARGET_S:g} s: the one sender's link makes it impossible ({servers} copies); with every "
            f'one of the {world} trainer GPUs sending its share (rollout.transfer_senders = "all"), each server\'s '
            f"own link bounds it: max({servers} x {size} / {world} / {link / GB:g} GB/s, {size} / "
            f"{link / GB:g} GB/s) = {spread:.1f} s"
        )
    elif total > SYNC_TARGET_S:
        bound = (
            "each server's own link" if version / link >= servers * version / senders / link else "the senders' links"
        )
        lines.append(f"  over {SYNC_TARGET_S:g} s: {bound} at {link / GB:g} GB/s make(s) it impossible")
    tcp = send * link / POD_TCP  # the same bytes over the slowest links, at the pod network's speed
    lines.append(
        f"  over pod TCP (NCCL_IB_DISABLE=1, about {POD_TCP / GB:g} GB/s): send {tcp:.0f} s: the pod network makes "
        f"{SYNC_TARGET_S:g} s impossible; RDMA devices in both pods (docs/production.md)"
    )
    return lines


SYNC_TARGET_S = 5.0
"""A sync the rollout side hardly notices: a few seconds between versions of minutes-long steps."""


def _n(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"

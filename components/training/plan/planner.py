"""`sao plan`: a preset's per-GPU training memory for every ZeRO stage and critic placement, and the cheapest
configuration that fits with `HEADROOM` free. This module reads the numbers from the config and writes the report;
layout.py places the models, memory.py and overheads.py do the arithmetic (and say where each figure comes from).
Whether the allocator's expandable segments are on is read from the environment `sao plan` runs in: the training
ranks' own when it runs where they start.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from components.config import Config, TrainConfig
from components.training.engines.deepspeed_config import read_deepspeed_file
from components.training.plan.fleet import H100, H200, fleet_lines, plan_fleet, sync_lines
from components.training.plan.layout import (
    HEADROOM,
    PLACEMENTS,
    GpuPlan,
    Workload,
    cheapest,
    fewest_gpus,
    longest_rows,
    plan,
    plans,
)
from components.training.plan.memory import Params, Zero
from components.training.plan.model import decoder_sizes, hf_config, policy_and_critic
from components.training.plan.overheads import (
    FRAGMENTATION_EXPANDABLE,
    Runtime,
    expandable_segments,
    fragmentation_share,
    nccl_group_bytes,
)
from components.training.rl.algorithms import ALGORITHMS

GB = 1e9
"""The report's unit: decimal gigabytes, as GPU capacities are sold (an H200's 141 GB)."""


def zero_settings(train: TrainConfig) -> Zero:
    """The ZeRO stage, precision and buffer sizes a run takes: `train.deepspeed_config`'s file where it sets them
    (its stage wins over `train.zero_stage`, as in the engines), DeepSpeed's defaults elsewhere. The torch backend
    is plain fp32 AdamW: stage 0, fp32."""
    if train.backend != "deepspeed":
        return Zero(stage=0, bf16=False)
    data = read_deepspeed_file(train.deepspeed_config) if train.deepspeed_config else {}
    zero = data.get("zero_optimization") or {}
    defaults = Zero(stage=0, bf16=False)
    return Zero(
        stage=zero.get("stage", train.zero_stage),
        bf16=bool((data.get("bf16") or {}).get("enabled", False)),
        reduce_bucket=int(zero.get("reduce_bucket_size", defaults.reduce_bucket)),
        prefetch_bucket=int(zero.get("stage3_prefetch_bucket_size", defaults.prefetch_bucket)),
        max_live=int(zero.get("stage3_max_live_parameters", defaults.max_live)),
        sub_group=int(zero.get("sub_group_size", defaults.sub_group)),
        offload=(zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme"),
    )


def runtime_settings(cfg: Config, environ: Mapping[str, str]) -> Runtime:
    """The weight transfer the rollout settings ask for (a collective one goes over NCCL from the policy's first
    GPU to every server) and whether `environ` turns the allocator's expandable segments on."""
    rc = cfg.rollout
    collective = rc.backend == "http" and rc.weight_transfer == "collective"
    return Runtime(
        transfer_servers=len(rc.urls) if collective else 0,
        transfer_bucket=rc.transfer_bucket_mb * 2**20 if collective else 0,
        publish_overlap=collective and rc.publish_overlap,
        expandable_segments=expandable_segments(environ),
    )


def workload(cfg: Config, environ: Mapping[str, str] | None = None) -> Workload:
    """The numbers `layout.plan` reads, from a config (model, algorithm, DeepSpeed file, batch and token budget,
    weight transfer) and the environment (`os.environ` unless given)."""
    algorithm = ALGORITHMS[cfg.train.algo]
    config = hf_config(cfg.model)
    policy, critic = policy_and_critic(config, algorithm.uses_critic, algorithm.freeze_critic_attention)
    return Workload(
        policy=policy,
        critic=critic,
        decoder=decoder_sizes(config),
        zero=zero_settings(cfg.train),
        batch_size=cfg.train.batch_size,
        longest=cfg.rollout.max_total_tokens,
        budget=cfg.train.micro_batch_tokens,
        checkpointing=cfg.train.activation_checkpointing,
        runtime=runtime_settings(cfg, os.environ if environ is None else environ),
    )


def report(
    cfg: Config,
    gpus: int,
    capacity_gb: float,
    environ: Mapping[str, str] | None = None,
    nodes: int = 1,
    link_gb_s: float = 50.0,
    mean_tokens: int | None = None,
) -> str:
    """`sao plan`'s output: the workload, one row per (stage, placement), what the configured plan's fullest GPU
    holds line by line, and the configuration to use: the cheapest plan that fits (keeps `HEADROOM` free) as
    configured, else with the leanest activations (checkpointing, one row per micro-batch), else how many GPUs, how
    short the rows or whether optimizer offload would do. `gpus` is per node; training runs on `nodes` x `gpus`.
    With rollout servers (`rollout.backend = "http"`), then the rollout side and the weight sync (fleet.py): the
    servers, the rollout GPUs that keep the trainer fed at trajectories of `mean_tokens` (default half of
    `rollout.max_total_tokens`), and a sync's time over links of `link_gb_s` between nodes."""
    for flag, value in (("--gpus", gpus), ("--nodes", nodes)):
        if value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    for flag, value in (("--gpu-memory-gb", capacity_gb), ("--link-gb-s", link_gb_s)):
        if value <= 0:
            raise ValueError(f"{flag}: must be > 0, got {value}")
    mean_tokens = mean_tokens or cfg.rollout.max_total_tokens // 2
    if not 1 <= mean_tokens <= cfg.rollout.max_total_tokens:
        raise ValueError(
            f"--mean-tokens: {mean_tokens} is not within 1 .. rollout.max_total_tokens {cfg.rollout.max_total_tokens}"
        )
    world = nodes * gpus
    w = workload(cfg, environ)
    capacity = capacity_gb * GB
    rows = plans(w, world, capacity)
    lines = [*_header(cfg, w, nodes, gpus, capacity_gb), "", *_table(rows), "", *_configured(cfg, w, world, capacity)]
    if cfg.rollout.backend == "http":
        lines += ["", *_rollout_side(cfg, w, nodes, gpus, capacity, link_gb_s * GB, mean_tokens)]
    lines.append("")
    if cheapest(rows) is not None:
        return "\n".join([*lines, *_choice(rows, cfg, {})])
    lean, lean_settings = _leanest(w)
    lean_rows = plans(lean, world, capacity)
    if lean_settings and cheapest(lean_rows) is not None:
        lines.append("nothing fits as configured; with " + ", ".join(f"{k} = {v}" for k, v in lean_settings.items()))
        return "\n".join([*lines, *_choice(lean_rows, cfg, lean_settings)])
    return "\n".join([*lines, *_nothing_fits(lean, lean_settings, world, capacity, capacity_gb, cfg.train)])


def _rollout_side(
    cfg: Config, w: Workload, nodes: int, gpus: int, capacity: float, link: float, mean_tokens: int
) -> list[str]:
    """The servers and the weight sync (fleet.py) on GPUs of the training GPUs' kind."""
    gpu = dataclasses.replace(H200 if capacity > H100.memory else H100, memory=capacity)
    fleet = plan_fleet(cfg, w.policy, w.decoder, gpu, nodes * gpus, mean_tokens)
    servers = max(len(cfg.rollout.urls), math.ceil(fleet.gpus_needed / fleet.tensor_parallel))
    return [
        *fleet_lines(cfg, fleet, w.policy, w.decoder, gpu, nodes, gpus, mean_tokens),
        *sync_lines(cfg, w.policy, nodes, gpus, link, servers),
    ]


def _leanest(w: Workload) -> tuple[Workload, dict[str, str]]:
    """`w` with the least activation memory the fields allow (activation checkpointing, micro-batches of one row),
    and the settings that changed."""
    settings = {}
    if not w.checkpointing:
        settings["train.activation_checkpointing"] = "true"
    if w.budget == 0 or w.budget > w.longest:
        settings["train.micro_batch_tokens"] = str(w.longest)
    return dataclasses.replace(w, checkpointing=True, budget=w.longest), settings


def _header(cfg: Config, w: Workload, nodes: int, gpus: int, capacity_gb: float) -> list[str]:
    precision = "bf16 weights, fp32 master weights and Adam moments" if w.zero.bf16 else "fp32"
    precision += ", the optimizer on the host (offload_optimizer)" if w.zero.offload else ""
    lines = [
        f"sao plan: preset {cfg.name}, algorithm {cfg.train.algo}, on "
        + (f"{nodes} nodes x {gpus} = {nodes * gpus} GPUs" if nodes > 1 else f"{gpus} GPU(s)")
        + f" of {capacity_gb:g} GB "
        f"(GB = 1e9 bytes; {precision})",
        f"policy  {_params(w.policy)}",
    ]
    if w.critic is not None:
        frozen = " (attention frozen)" if w.critic.trainable < w.critic.total else ""
        lines.append(f"critic  {_params(w.critic)}{frozen}")
    budget = f"{w.budget:,} padded tokens per micro-batch" if w.budget else "a rank's whole share in one pass"
    lines.append(
        f"rows of up to {w.longest:,} tokens, {w.batch_size} per step; {budget}; activation checkpointing "
        f"{'on' if w.checkpointing else 'off'}"
    )
    r = w.runtime
    transfer = (
        f"collective to {r.transfer_servers} server(s) in buckets of {r.transfer_bucket / 2**20:g} MiB, "
        + ("during the next step" if r.publish_overlap else "between steps")
        if r.transfer_servers
        else "none from the GPUs"
    )
    allocator = (
        "on" if r.expandable_segments else "off (PYTORCH_ALLOC_CONF=expandable_segments:True where the ranks start)"
    )
    lines += [f"weight transfer: {transfer}", f"the allocator's expandable segments in this environment: {allocator}"]
    return lines


def _params(p: Params) -> str:
    return f"{_count(p.total)} parameters, {_count(p.trainable)} trainable, largest layer {_count(p.largest_layer)}"


def _count(n: int) -> str:
    """30.53B, 0.77M, 2049."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e4 else str(n)


COLUMNS = (
    "stage",
    "placement",
    "GPU holds",
    "weights",
    "grads",
    "optimizer",
    "step",
    "activations",
    "logits",
    "buffers",
    "gather",
    "transfer",
    "nccl",
    "reserve",
    "peak",
    "free",
    "",
)


def _table(rows: list[GpuPlan]) -> list[str]:
    """One line per plan, the fullest GPU's bytes in GB: its models' states summed; activations, logits, buffers and
    gathered parameters of the model with the larger backward; step the larger optimizer step; then what the GPU
    holds besides its models (overheads.py)."""
    cells = [COLUMNS]
    for p in rows:
        gpu = p.fullest
        backward = max(gpu.models, key=lambda m: m.backward)
        values = (
            sum(m.weights for m in gpu.models),
            sum(m.gradients for m in gpu.models),
            sum(m.optimizer for m in gpu.models),
            max(m.step_gradients for m in gpu.models),
            backward.activations,
            backward.logits,
            backward.buffers,
            backward.gather,
            gpu.transfer,
            gpu.nccl,
            gpu.fragmentation,
            p.peak,
            p.free,
        )
        cells.append((str(p.stage), _where(p), gpu.holds, *(f"{v / GB:.1f}" for v in values), _verdict(p)))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    left = {1, 2, len(COLUMNS) - 1}
    lines = [
        "  ".join(c.ljust(wd) if i in left else c.rjust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return [
        *(line.rstrip() for line in lines),
        "peak = weights + grads + optimizer + the larger of (activations + logits + buffers + gather) and step, "
        "+ transfer + nccl + reserve (fragmentation)",
        f"free = the GPU's memory - peak, and a plan fits with {HEADROOM:.0%} free; separate a+b: policy on a GPUs, "
        "critic on b",
    ]


def _where(p: GpuPlan) -> str:
    return f"shared {p.gpus}" if p.placement == "shared" else f"separate {p.policy_ranks}+{p.critic_ranks}"


def _verdict(p: GpuPlan) -> str:
    if p.fits:
        return "fits"
    return f"under {HEADROOM:.0%} free" if p.free >= 0 else "does not fit"


def _configured(cfg: Config, w: Workload, gpus: int, capacity: float) -> list[str]:
    """The configured plan (the run's ZeRO stage and `train.critic_ranks`) line by line on its fullest GPU, each
    line with where it comes from; nothing when `--gpus` cannot hold that placement."""
    separate = w.critic is not None and 0 < cfg.train.critic_ranks < gpus
    if cfg.train.critic_ranks and not separate:
        return []
    p = plan(w, gpus, w.zero.stage, "separate" if separate else "shared", capacity, cfg.train.critic_ranks)
    return [
        f"as configured (ZeRO-{p.stage}, {_where(p)}), the fullest GPU ({p.fullest.holds}):",
        *_lines(p, w),
    ]


def _lines(p: GpuPlan, w: Workload) -> list[str]:
    """Each thing the fullest GPU of `p` holds, in GB, with its source."""
    gpu = p.fullest
    states = [sum(getattr(m, k) for m in gpu.models) for k in ("weights", "gradients", "optimizer")]
    backward = max(gpu.models, key=lambda m: m.backward)
    step = max(m.step_gradients for m in gpu.models)
    working = (
        f"a backward: activations {backward.activations / GB:.1f}, logits {backward.logits / GB:.1f}, ZeRO's buckets "
        f"{backward.buffers / GB:.1f}, gathered parameters {backward.gather / GB:.1f}"
        if backward.backward >= step
        else "the optimizer step's fp32 gradients"
    )
    rows = [
        (
            "model states",
            sum(states),
            "weights {:.1f}, gradients {:.1f}, optimizer {:.1f}".format(*(v / GB for v in states)),
        ),
        ("working set", max(backward.backward, step), working),
    ]
    if gpu.transfer:
        r = w.runtime
        when = (
            "during the next step (rollout.publish_overlap)" if r.publish_overlap else "between steps (an upper bound)"
        )
        largest = (2 if w.zero.bf16 else 4) * w.policy.largest_param
        bucket = f"max({r.transfer_bucket / 2**20:g} MiB, the largest parameter's {largest / GB:.2f} GB)"
        rows.append(
            ("weight transfer", gpu.transfer, f"2 buckets of {bucket} per server ({r.transfer_servers}), {when}")
        )
    sizes = ", ".join(f"{n} ({nccl_group_bytes(n) / GB:.2f})" for n in gpu.groups)
    rows += [
        ("NCCL", gpu.nccl, f"one rank's buffers in communicators of {sizes} GPUs (overheads.py)"),
        (
            "fragmentation",
            gpu.fragmentation,
            f"{fragmentation_share(gpu.expandable):.0%} of the allocator's {gpu.allocated / GB:.1f} GB"
            + (
                ""
                if gpu.expandable
                else f" without expandable segments ({FRAGMENTATION_EXPANDABLE:.0%} with "
                "PYTORCH_ALLOC_CONF=expandable_segments:True)"
            ),
        ),
        ("peak", p.peak, ""),
        (
            "free",
            p.free,
            f"of {p.capacity / GB:g} GB ({p.free / p.capacity:.1%}); a plan fits with {HEADROOM:.0%} free",
        ),
    ]
    if gpu.host:
        rows.append(("host memory", gpu.host, "the offloaded optimizers' states and fp32 gradients, per GPU"))
    return [f"  {name:<15}{value / GB:>7.1f} GB  {source}".rstrip() for name, value, source in rows]


def _choice(rows: list[GpuPlan], cfg: Config, changed: dict[str, str]) -> list[str]:
    """The cheapest plan that fits, as settings (`changed`: settings it needs besides the stage); when it places
    the critic apart, also the cheapest shared one, which the trainer runs today."""
    best = cheapest(rows)
    lines = _settings("cheapest that fits", best, cfg, changed)
    shared = cheapest([p for p in rows if p.placement == "shared"])
    if best.placement == "separate" and shared is not None:
        lines += _settings("cheapest shared (the trainer's placement today)", shared, cfg, changed)
    return lines


def _settings(title: str, p: GpuPlan, cfg: Config, changed: dict[str, str]) -> list[str]:
    models = "policy and critic" if p.critic is not None else "the policy"
    where = (
        f"{models} on every GPU ({p.gpus})"
        if p.placement == "shared"
        else f"policy on {p.policy_ranks} GPUs, critic on {p.critic_ranks}"
    )
    lines = [
        f"{title}: ZeRO-{p.stage}, {where}: peak {p.peak / GB:.1f} GB of {p.capacity / GB:g} GB, "
        f"{p.free / GB:.1f} GB free ({p.free / p.capacity:.0%})"
    ]
    settings = [f"train.zero_stage = {p.stage}"]
    file = _deepspeed_file(cfg.train, p.stage)
    if file:
        settings.append(f'train.deepspeed_config = "{file}"')
    settings += [f"{key} = {value}" for key, value in changed.items()]
    if p.placement == "separate":
        settings.append(f"train.critic_ranks = {p.critic_ranks}")
    return [*lines, "  settings: " + ", ".join(settings)]


def _deepspeed_file(train: TrainConfig, stage: int) -> str | None:
    """A DeepSpeed file for `stage`: the run's own if its stage is that, else one beside it whose stage is (its
    stage wins over train.zero_stage); None when the run has no file and needs none."""
    if not train.deepspeed_config:
        return None
    own = Path(train.deepspeed_config)
    if zero_settings(train).stage == stage:
        return str(own)
    for candidate in sorted(own.parent.glob("*.json")):
        if (json.loads(candidate.read_text()).get("zero_optimization") or {}).get("stage") == stage:
            return str(candidate)
    return f"a copy of {own} with zero_optimization.stage = {stage}"


def _nothing_fits(
    lean: Workload, lean_settings: dict[str, str], gpus: int, capacity: float, capacity_gb: float, train: TrainConfig
) -> list[str]:
    """When no plan fits even with the leanest activations: how many GPUs would, how long rows may be here, and
    whether the optimizer on the host (DeepSpeed's offload) would fit these GPUs."""
    how = ", ".join(f"{k} = {v}" for k, v in lean_settings.items())
    lines = [
        f"nothing fits on {gpus} GPU(s) of {capacity_gb:g} GB with {HEADROOM:.0%} free"
        + (f", even with {how}" if how else "")
    ]
    placements = PLACEMENTS if lean.critic is not None else ("shared",)
    for p in filter(None, (fewest_gpus(lean, capacity, gpus + 1, placement) for placement in placements)):
        lines.append(
            f"  rows of {lean.longest:,} tokens fit on {p.gpus} GPUs: ZeRO-{p.stage}, {_where(p)}, "
            f"peak {p.peak / GB:.1f} GB"
        )
    longest = longest_rows(lean, gpus, capacity)
    if longest:
        lines.append(
            f"  on {gpus} GPU(s), rows of up to {longest:,} tokens fit: rollout.max_total_tokens = {longest}, "
            f"train.micro_batch_tokens = {longest}, train.activation_checkpointing = true"
        )
    if not lean.zero.offload:
        offloaded = dataclasses.replace(lean, zero=dataclasses.replace(lean.zero, offload=True))
        fitting = [p for p in plans(offloaded, gpus, capacity) if p.fits]
        if fitting:  # the run's own stage and the shared placement first: the least to change
            best = min(fitting, key=lambda p: (p.stage != lean.zero.stage, p.placement != "shared", p.per_model))
            file = _deepspeed_file(train, best.stage)
            file = (
                f"{file} and"
                if file and file.startswith("a copy of")
                else f"a copy of {file or 'a DeepSpeed file'} with"
            )
            lines += [
                f"  on {gpus} GPU(s) with the optimizer on the host: ZeRO-{best.stage}, {_where(best)}, peak "
                f"{best.peak / GB:.1f} GB, {best.free / GB:.1f} GB free ({best.free / best.capacity:.0%}), "
                f"{best.fullest.host / GB:.1f} GB of host memory per GPU:",
                f'    {file} zero_optimization.offload_optimizer = {{"device": "cpu"}}',
            ]
    return lines

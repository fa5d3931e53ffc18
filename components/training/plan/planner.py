"""`sao plan`: a preset's per-GPU training memory for every ZeRO stage and critic placement, and the cheapest
configuration that fits. This module reads the numbers from the config and writes the report; layout.py places
the models and memory.py does the arithmetic (and says where each figure comes from).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from components.config import Config, TrainConfig
from components.training.engines.deepspeed_config import read_deepspeed_file
from components.training.plan.layout import (
    PLACEMENTS,
    GpuPlan,
    Workload,
    cheapest,
    fewest_gpus,
    longest_rows,
    plans,
)
from components.training.plan.memory import Params, Zero
from components.training.plan.model import decoder_sizes, hf_config, policy_and_critic
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
    )


def workload(cfg: Config) -> Workload:
    """The numbers `layout.plan` reads, from a config (model, algorithm, DeepSpeed file, batch and token budget)."""
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
    )


def report(cfg: Config, gpus: int, capacity_gb: float) -> str:
    """`sao plan`'s output: the workload, one row per (stage, placement), and the configuration to use: the
    cheapest plan that fits as configured, else with the leanest activations (checkpointing, one row per
    micro-batch), else how many GPUs or how short the rows would have to be."""
    if gpus < 1:
        raise ValueError(f"--gpus: must be >= 1, got {gpus}")
    if capacity_gb <= 0:
        raise ValueError(f"--gpu-memory-gb: must be > 0, got {capacity_gb}")
    w = workload(cfg)
    capacity = capacity_gb * GB
    rows = plans(w, gpus, capacity)
    lines = [*_header(cfg, w, gpus, capacity_gb), "", *_table(rows), ""]
    if cheapest(rows) is not None:
        return "\n".join([*lines, *_choice(rows, cfg, {})])
    lean, lean_settings = _leanest(w)
    lean_rows = plans(lean, gpus, capacity)
    if lean_settings and cheapest(lean_rows) is not None:
        lines.append("nothing fits as configured; with " + ", ".join(f"{k} = {v}" for k, v in lean_settings.items()))
        return "\n".join([*lines, *_choice(lean_rows, cfg, lean_settings)])
    return "\n".join([*lines, *_nothing_fits(lean, lean_settings, gpus, capacity, capacity_gb)])


def _leanest(w: Workload) -> tuple[Workload, dict[str, str]]:
    """`w` with the least activation memory the fields allow (activation checkpointing, micro-batches of one row),
    and the settings that changed."""
    settings = {}
    if not w.checkpointing:
        settings["train.activation_checkpointing"] = "true"
    if w.budget == 0 or w.budget > w.longest:
        settings["train.micro_batch_tokens"] = str(w.longest)
    return dataclasses.replace(w, checkpointing=True, budget=w.longest), settings


def _header(cfg: Config, w: Workload, gpus: int, capacity_gb: float) -> list[str]:
    precision = "bf16 weights, fp32 master weights and Adam moments" if w.zero.bf16 else "fp32"
    lines = [
        f"sao plan: preset {cfg.name}, algorithm {cfg.train.algo}, on {gpus} GPU(s) of {capacity_gb:g} GB "
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
    "peak",
    "",
)


def _table(rows: list[GpuPlan]) -> list[str]:
    """One line per plan, the fullest GPU's bytes in GB: its models' states summed; activations, logits and
    buffers of the model with the larger backward; step the larger optimizer step."""
    cells = [COLUMNS]
    for p in rows:
        holds, models = p.fullest
        backward = max(models, key=lambda m: m.backward)
        where = f"shared {p.gpus}" if p.placement == "shared" else f"separate {p.policy_ranks}+{p.critic_ranks}"
        values = (
            sum(m.weights for m in models),
            sum(m.gradients for m in models),
            sum(m.optimizer for m in models),
            max(m.step_gradients for m in models),
            backward.activations,
            backward.logits,
            backward.buffers,
            p.peak,
        )
        verdict = "fits" if p.fits else "does not fit"
        cells.append((str(p.stage), where, holds, *(f"{v / GB:.1f}" for v in values), verdict))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    left = {1, 2, len(COLUMNS) - 1}
    lines = [
        "  ".join(c.ljust(wd) if i in left else c.rjust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
        for row in cells
    ]
    return [
        *(line.rstrip() for line in lines),
        "peak = weights + grads + optimizer + the larger of (activations + logits + buffers) and step; "
        "separate a+b: policy on a GPUs, critic on b",
    ]


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
    lines = [f"{title}: ZeRO-{p.stage}, {where}: peak {p.peak / GB:.1f} GB of {p.capacity / GB:g} GB"]
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
    lean: Workload, lean_settings: dict[str, str], gpus: int, capacity: float, capacity_gb: float
) -> list[str]:
    """When no plan fits even with the leanest activations: how many GPUs would, and how long rows may be here."""
    how = ", ".join(f"{k} = {v}" for k, v in lean_settings.items())
    lines = [f"nothing fits on {gpus} GPU(s) of {capacity_gb:g} GB" + (f", even with {how}" if how else "")]
    placements = PLACEMENTS if lean.critic is not None else ("shared",)
    for p in filter(None, (fewest_gpus(lean, capacity, gpus + 1, placement) for placement in placements)):
        where = f"shared {p.gpus}" if p.placement == "shared" else f"separate {p.policy_ranks}+{p.critic_ranks}"
        lines.append(
            f"  rows of {lean.longest:,} tokens fit on {p.gpus} GPUs: ZeRO-{p.stage}, {where}, "
            f"peak {p.peak / GB:.1f} GB"
        )
    longest = longest_rows(lean, gpus, capacity)
    if longest:
        lines.append(
            f"  on {gpus} GPU(s), rows of up to {longest:,} tokens fit: rollout.max_total_tokens = {longest}, "
            f"train.micro_batch_tokens = {longest}, train.activation_checkpointing = true"
        )
    return lines

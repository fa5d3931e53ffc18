"""What the planner counts: a model's architecture (its Hugging Face config) and its parameters, on the meta device.

The config is `model.path`'s `config.json` when that directory is on this machine; else the architecture shipped
as `architectures/<the directory's name>.json` (the GPU presets' model is not on a CPU machine, and nothing is ever
downloaded); a preset without a path is built from its `[model]` fields as components/models/policy.py
`build_policy` does. The policy is `AutoModelForCausalLM.from_config` under `torch.device("meta")`, so no weight is
materialised; the critic is `ValueModel.from_policy` of it with its attention frozen by `freeze_attention` when the
algorithm freezes it, the same two calls the learner makes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, Qwen3MoeConfig

from components.config import ModelConfig
from components.models import ValueModel, freeze_attention
from components.models.policy import policy_config
from components.models.tokenizer import config_tokenizer
from components.training.plan.memory import Decoder, Params

ARCHITECTURES = Path(__file__).parent / "architectures"
"""Shipped `config.json`s, named after the model directory they stand for."""


def hf_config(model: ModelConfig) -> PretrainedConfig:
    """The architecture the `[model]` section trains (module docstring); errors name `model.path`."""
    if model.path is None:
        return _config_from_fields(model)
    local = Path(model.path) / "config.json"
    if local.is_file():
        return AutoConfig.from_pretrained(model.path, local_files_only=True)
    shipped = ARCHITECTURES / f"{Path(model.path).name}.json"
    if not shipped.is_file():
        known = sorted(p.stem for p in ARCHITECTURES.glob("*.json"))
        raise FileNotFoundError(
            f"model.path: {model.path} has no config.json on this machine and no architecture ships for "
            f"{Path(model.path).name!r} in {ARCHITECTURES} (shipped: {known})"
        )
    data = json.loads(shipped.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _config_from_fields(model: ModelConfig) -> Qwen3MoeConfig:
    """`build_policy`'s config for a model built from the preset's fields (its vocabulary is the tokenizer's)."""
    return policy_config(model, config_tokenizer(model.tokenizer))


def count_params(model: nn.Module) -> Params:
    """Total and trainable parameters (a shared tensor once), the most one module holds itself, and the largest
    single parameter."""
    params = list(model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return Params(
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        largest_layer=largest,
        largest_param=max(p.numel() for p in params),
    )


def policy_and_critic(config: PretrainedConfig, critic: bool, frozen_attention: bool) -> tuple[Params, Params | None]:
    """Parameter counts of the policy and, when the algorithm trains one, the critic (attention frozen or not)."""
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(config)
        value = ValueModel.from_policy(policy) if critic else None
    if value is not None and frozen_attention:
        freeze_attention(value)
    return count_params(policy), (count_params(value) if value is not None else None)


def decoder_sizes(config: PretrainedConfig) -> Decoder:
    """The sizes `memory.activation_bytes` reads; a config without one of them is refused, naming it."""
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in config]
    if missing:
        raise ValueError(f"model.path: the model's config has no {missing}; the planner reads decoder configs only")
    heads = config.num_attention_heads
    experts = getattr(config, "num_experts", 0) or 0
    if experts and (getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1):
        raise ValueError("model.path: dense layers between the MoE layers are not planned (mlp_only_layers)")
    return Decoder(
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        experts=experts,
        top_k=config.num_experts_per_tok if experts else 1,
        intermediate=config.moe_intermediate_size if experts else config.intermediate_size,
        vocab=config.vocab_size,
    )

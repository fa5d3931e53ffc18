"""Policy construction: a tiny Qwen3-MoE from a preset config, or any local HF causal LM directory.

Model directories are standard HF layout (config.json, model.safetensors, tokenizer.json) so transformers,
the embedded engine and vLLM all load the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from components.config import ModelConfig
from components.models.tokenizer import config_tokenizer, load_tokenizer


def policy_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen3MoeConfig:
    """The Qwen3-MoE architecture the `[model]` fields describe, on `tokenizer`'s vocabulary."""
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size * cfg.experts_per_token,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        # Untied: vLLM's in-place weight reload skips a tied LM head ("ParallelLMHead: Failed to load weights").
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def build_policy(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A freshly initialised Qwen3-MoE sized by `cfg` (initialised in fp32, then cast to `dtype`), or the model at
    `cfg.path` when set, loaded in `dtype`."""
    if cfg.path is not None:
        return load_policy(cfg.path, dtype)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(policy_config(cfg, tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local directory; a missing directory is an error, never a hub download."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def save_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """Write config, safetensors weights and tokenizer.json; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def init_model_dir(cfg: ModelConfig, path: str | Path, seed: int = 0) -> Path:
    """`sao model init`: a fresh preset model and its tokenizer (`model.tokenizer`) as an HF directory."""
    tokenizer = config_tokenizer(cfg.tokenizer)
    return save_model_dir(build_policy(cfg, tokenizer, seed), tokenizer, path)


__all__ = ["build_policy", "init_model_dir", "load_policy", "load_tokenizer", "policy_config", "save_model_dir"]

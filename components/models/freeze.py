"""Frozen-attention critic (SAO paper, "Frozen-Attention"; docs/design.md section 2).

Attention parameters are those of every attention module of a transformers decoder: the q/k/v/o projections
and the norms that live inside the attention block (Qwen3's q_norm/k_norm). Norms outside attention
(input/post-attention layernorms), MLP/MoE projections, the router, embeddings and the value head stay
trainable. Which modules count as attention is decided by class name (`...Attention`) or module name
(`self_attn`, `attn`, `attention`), which covers the Qwen3, Qwen3-MoE, Llama, Mistral and GPT-2 families.
"""

from __future__ import annotations

from torch import nn

_ATTENTION_MODULE_NAMES = frozenset({"self_attn", "attn", "attention", "self_attention"})


def is_attention_module(qualified_name: str, module: nn.Module) -> bool:
    """True for an attention block of a transformers decoder."""
    leaf = qualified_name.rsplit(".", 1)[-1]
    return type(module).__name__.endswith("Attention") or leaf in _ATTENTION_MODULE_NAMES


def freeze_attention(model: nn.Module) -> list[str]:
    """Set `requires_grad=False` on every attention parameter; return their names, sorted.

    Raises:
        ValueError: when the model has no recognisable attention parameter, so that a new model family
            never silently trains a full-parameter critic.
    """
    frozen: set[str] = set()
    for name, module in model.named_modules():
        if name and is_attention_module(name, module):
            for param_name, param in module.named_parameters(prefix=name):
                param.requires_grad_(False)
                frozen.add(param_name)
    if not frozen:
        raise ValueError(
            f"freeze_attention: found no attention parameters in {type(model).__name__}; "
            "expected modules named self_attn/attn/attention or classes ending in 'Attention'"
        )
    return sorted(frozen)

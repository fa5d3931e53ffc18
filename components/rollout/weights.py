"""Reading published weights (HF model directory or safetensors file) and checking them against a model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM


def read_weights(source: str | Path) -> dict[str, torch.Tensor]:
    """In-memory state dict from an HF model directory, or the tensors of a safetensors file.

    A directory is loaded through transformers because checkpoints and live modules name tensors
    differently (transformers 5 stores Qwen3-MoE experts one by one on disk, fused in memory); a bare
    safetensors file must already use the live module's names.
    """
    path = Path(source)
    if path.is_file():
        return load_file(str(path))
    if not path.is_dir():
        raise FileNotFoundError(f"path: {path} is neither a safetensors file nor a model directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"path: {path} has no config.json")

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    return model.state_dict()


def validate_weights(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor must name a parameter/buffer of `model` with the same shape, and every parameter must be
    provided unless it is tied to one that is (e.g. `lm_head.weight` tied to the embeddings)."""
    state = model.state_dict()
    for name, tensor in tensors.items():
        if name not in state:
            raise ValueError(f"weights: unexpected tensor {name!r} for {type(model).__name__}")
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise ValueError(
                f"weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(state[name].shape)}"
            )
    provided_storage = {state[name].data_ptr() for name in tensors}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in tensors and param.data_ptr() not in provided_storage:
            raise ValueError(f"weights: missing tensor {name!r}")

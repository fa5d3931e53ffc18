"""Value model: the policy's backbone with a scalar head (docs/design.md section 2, "Critic").

`values[b, t] = V(s_t)` is read from the hidden state at position t-1, the same position whose logits give
`logprobs[b, t]`; position 0 has no state before it and reads 0.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """Backbone (a transformers base model) + `value_head: Linear(hidden, 1)` in the backbone's dtype.

    One dtype for every parameter: DeepSpeed's bf16 engines flatten a module's parameters into one buffer and
    refuse a fp32 head beside a bf16 backbone. `forward` returns fp32 values whatever the dtype."""

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        dtype = backbone.dtype
        if head is None:
            head = nn.Linear(hidden, 1)  # initialised in fp32, then cast: the same draws whatever the dtype
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(head.bias)
        self.value_head = head.to(dtype)

    @classmethod
    def from_policy(cls, policy: PreTrainedModel) -> ValueModel:
        """Initialise from a policy (e.g. the SFT checkpoint): a copy of its decoder and a fresh head."""
        return cls(copy.deepcopy(policy.get_decoder()))

    @classmethod
    def from_policy_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        """The decoder of the policy saved at `path` and a fresh head: `from_policy` without holding the policy
        (under ZeRO-3 the backbone loads into its partitions). The head's initialisation draws from torch's global
        generator as `from_policy`'s does; loading the backbone draws nothing from it."""
        path = Path(path)
        with torch.random.fork_rng(devices=[]):
            policy = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        return cls(policy.get_decoder())

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """`(B, T)` ids -> `(B, T)` float32 values, `values[:, t] = head(hidden[:, t-1])`, `values[:, 0] = 0`."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        v = self.value_head(hidden).squeeze(-1).float()
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(path), safe_serialization=True)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()}, str(path / HEAD_FILE))
        return path

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        path = Path(path)
        if not (path / HEAD_FILE).exists():
            raise FileNotFoundError(f"value model directory {path} has no {HEAD_FILE}")
        backbone = AutoModel.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        head = nn.Linear(backbone.config.hidden_size, 1)
        head.load_state_dict(load_file(str(path / HEAD_FILE)))
        return cls(backbone, head)

"""Right-padded token batches with action masks."""

from __future__ import annotations

import torch
from torch import Tensor


def pad_batch(sequences: list[list[int]], masks: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad to the longest sequence.

    Returns:
        input_ids `(B, T)`, attention_mask `(B, T)` (1 on real tokens), action_mask `(B, T)` float (1 on actions).
    """
    if len(sequences) != len(masks):
        raise ValueError(f"masks has {len(masks)} rows, sequences has {len(sequences)}")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(sequences), length, dtype=torch.long)
    action = torch.zeros(len(sequences), length, dtype=torch.float32)
    for row, (seq, mask) in enumerate(zip(sequences, masks)):
        if len(seq) != len(mask):
            raise ValueError(f"row {row}: action mask has {len(mask)} entries, token ids {len(seq)}")
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[row, : len(seq)] = 1
        action[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return ids, attention, action

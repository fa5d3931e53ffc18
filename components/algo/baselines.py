"""Advantage baselines other than the critic: GRPO group normalisation and a running-mean reward baseline,
plus optional advantage normalisation as its own step (off by default for SAO, docs/design.md section 2).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from components.algo.reductions import masked_mean, masked_var


def grpo_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, DeepSeekMath section 4.1.2).

    Args:
        rewards: `(G, N)` outcome reward of each of the N rollouts of G prompts.
        scale_by_std: divide by the group's standard deviation (unbiased, as GRPO does); False gives
            Dr. GRPO's mean-only centring.
        eps: added to the std so a group with equal rewards gets advantage 0, not NaN.

    Returns:
        `(G, N)` advantages, one per rollout (broadcast over its action tokens by the caller).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (num_groups, group_size >= 2), got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


class RunningMeanBaseline:
    """Mean of the last `window` outcome rewards: the `sao-running-mean` ablation's baseline.

    The advantage of a trajectory is `reward - baseline` evaluated *before* its reward enters the window.
    After a reward shift the baseline lags by up to `window` trajectories: the failure mode the SAO paper's
    online-learning experiment shows against a state-dependent critic.
    """

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._rewards: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float:
        """Current baseline; 0 before any reward was seen."""
        return sum(self._rewards) / len(self._rewards) if self._rewards else 0.0

    def advantages(self, rewards: Tensor) -> Tensor:
        """`(N,)` rewards -> `(N,)` advantages against the current baseline, then add the rewards to the window."""
        baseline = self.value
        for r in rewards.detach().reshape(-1).tolist():
            self._rewards.append(float(r))
        return rewards - baseline

    def state_dict(self) -> dict:
        return {"window": self.window, "rewards": list(self._rewards)}

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self._rewards = deque((float(r) for r in state["rewards"]), maxlen=self.window)


def normalize_advantages(
    advantages: Tensor,
    mask: Tensor,
    eps: float = 1e-8,
    moments: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> Tensor:
    """Whiten advantages over the masked tokens of the mini-batch: `(A - mean) / (std + eps)`, 0 off the mask.

    `moments(x, mask) -> (mean, variance)` replaces the local masked moments (e.g. by those over every
    data-parallel rank). Shapes: advantages, mask `(B, T)`.
    """
    if moments is None:
        mean, var = masked_mean(advantages, mask), masked_var(advantages, mask)
    else:
        mean, var = moments(advantages, mask)
    std = var.sqrt()
    out = (advantages - mean) / (std + eps)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


def broadcast_sequence_advantages(seq_advantages: Tensor, action_mask: Tensor) -> Tensor:
    """Place one advantage per sequence on each of its action tokens: `(B,)`, `(B, T)` -> `(B, T)`."""
    if seq_advantages.shape != action_mask.shape[:1]:
        raise ValueError(
            f"seq_advantages shape {tuple(seq_advantages.shape)} does not match batch size {action_mask.shape[0]}"
        )
    return seq_advantages[:, None].to(torch.float32) * action_mask.to(torch.float32)

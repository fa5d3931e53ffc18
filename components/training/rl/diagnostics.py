"""Per-step diagnostics of the policy update, the signals a collapse shows first (stability issue,
docs/stability.md): where the entropy sits (on tokens the policy would pick greedily, or on the rest), how
far the advantages of failed and successful trajectories lie apart, and the most extreme trajectory.

Every value is whole-batch under torchrun: sums and counts are all-reduced before dividing, the per-row
values gathered, so two ranks report what one process would. An empty subset reports 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.models.logprobs import TokenStats
from components.training.engines.collective import Collective


def policy_diagnostics(
    stats: TokenStats, advantages: Tensor, batch: dict[str, Tensor], comm: Collective
) -> dict[str, Tensor]:
    """Metrics from the policy's forward pass on the batch (before its update).

    Args:
        stats: `TokenStats` of the current policy on the batch, `(B, T)` each.
        advantages: `(B, T)` advantages the update uses.
        batch: the trainer batch (`action_mask`, `rewards` with the outcome reward on the last action token).

    Returns:
        policy/entropy_argmax, policy/entropy_other: mean entropy on action tokens that are / are not the
            current policy's argmax;
        policy/nonargmax_frac: share of action tokens that are not the argmax (what greedy decoding would
            not produce);
        adv/failed_mean, adv/success_mean: mean advantage on the action tokens of trajectories whose outcome
            reward is <= 0 / > 0;
        adv/traj_extreme: the per-trajectory mean advantage of largest magnitude, with its sign.
    """
    act = batch["action_mask"].bool()
    outcome = batch["rewards"].sum(dim=1)
    subsets = {
        "argmax": act & stats.is_argmax,
        "other": act & ~stats.is_argmax,
        "failed": act & (outcome <= 0)[:, None],
        "success": act & (outcome > 0)[:, None],
    }
    values = {"argmax": stats.entropy, "other": stats.entropy, "failed": advantages, "success": advantages}
    zero = torch.zeros((), dtype=torch.float32)
    sums = comm.sum(
        torch.stack(
            [torch.stack([torch.where(m, values[k].float(), zero).sum(), m.sum().float()]) for k, m in subsets.items()]
        )
    )
    means = dict(zip(subsets, sums[:, 0] / sums[:, 1].clamp(min=1)))
    counts = dict(zip(subsets, sums[:, 1]))
    row_adv = torch.where(act, advantages.float(), zero).sum(dim=1) / act.sum(dim=1).clamp(min=1)
    rows, _ = comm.gather_rows(row_adv)
    return {
        "policy/entropy_argmax": means["argmax"],
        "policy/entropy_other": means["other"],
        "policy/nonargmax_frac": counts["other"] / (counts["argmax"] + counts["other"]).clamp(min=1),
        "adv/failed_mean": means["failed"],
        "adv/success_mean": means["success"],
        "adv/traj_extreme": rows[rows.abs().argmax()] if rows.numel() else zero,
    }

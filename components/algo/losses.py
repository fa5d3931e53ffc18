"""Policy and value losses: DIS (SAO), PPO clip (baselines), clipped value loss.

All losses are token-level means over the action tokens of the whole mini-batch and return
`(loss, metrics)` with detached metric tensors named as in docs/design.md section 6.

DIS follows docs/design.md section 2 and the SAO paper's calibration function
`f(x) = x if 1 - eps_low < x < 1 + eps_high else 0`: tokens outside the open window are masked (zero loss,
exactly zero gradient), not clamped to the boundary as PPO does. The ratio is taken against the rollout
engine's logged log-probs; no old policy is recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.algo.reductions import masked_mean

# (eps_low, eps_high) from the SAO paper: reasoning (AIME/HMMT runs) and coding (SWE-Bench runs).
DIS_PRESETS: dict[str, tuple[float, float]] = {"reasoning": (0.3, 5.0), "coding": (0.8, 3.0)}


def dis_window_mask(ratio: Tensor, action_mask: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Boolean `(B, T)` mask of action tokens whose ratio lies in the open window `(1 - eps_low, 1 + eps_high)`."""
    return action_mask.bool() & (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


def dis_policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Direct Double-Sided Importance Sampling loss.

        ratio_t = exp(logprobs_t - rollout_logprobs_t)
        loss    = - sum_t keep_t * ratio_t * A_t / sum_t action_mask_t

    Args:
        logprobs: `(B, T)` log pi_theta(x_t | x_<t) under the sampling distribution, with grad.
        rollout_logprobs: `(B, T)` the rollout engine's log-probs of the same tokens; ignored off action tokens.
        advantages: `(B, T)` advantage per token (treated as a constant).
        action_mask: `(B, T)` 1 on sampled tokens.
        eps_low, eps_high: window half-widths; `eps_low >= 1` means no lower bound.

    Returns:
        `(loss, metrics)`; the gradient w.r.t. `logprobs_t` is `-ratio_t * A_t / N` inside the window, 0 outside.
    """
    _check_same_shape(
        logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages, action_mask=action_mask
    )
    if eps_low <= 0 or eps_high <= 0:
        raise ValueError(f"eps_low and eps_high must be > 0, got {eps_low}, {eps_high}")
    acting = action_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(acting, logprobs - rollout_logprobs, zero)
    ratio_detached = log_ratio.detach().exp()
    keep = dis_window_mask(ratio_detached, acting, eps_low, eps_high)
    # exp() only of kept tokens: a huge masked log-ratio would give inf * 0 = NaN in the backward pass.
    ratio = torch.where(keep, log_ratio, zero).exp()
    per_token = torch.where(keep, ratio * advantages.detach(), zero)
    n_action = acting.sum().clamp(min=1)
    loss = -per_token.sum() / n_action

    metrics = {
        "policy/loss": loss.detach(),
        "dis/ratio_mean": masked_mean(ratio_detached, acting),
        "dis/masked_frac_low": masked_mean((ratio_detached <= 1.0 - eps_low).to(logprobs.dtype), acting),
        "dis/masked_frac_high": masked_mean((ratio_detached >= 1.0 + eps_high).to(logprobs.dtype), acting),
        "dis/approx_kl": _k3_kl(log_ratio.detach(), acting),
    }
    return loss, metrics


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), token-level mean over action tokens.

        loss = - mean_t min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)

    `old_logprobs` is either the rollout engine's log-probs (decoupled-free, as GRPO baselines run here) or
    log-probs recomputed by the trainer before the update. Shapes as in `dis_policy_loss`.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, action_mask=action_mask)
    acting = action_mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(acting, logprobs - old_logprobs, zero)
    # Bound the exponent: beyond +-20 the clipped branch is selected anyway, and exp would overflow.
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    adv = advantages.detach()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -masked_mean(torch.minimum(unclipped, clipped), acting)
    was_clipped = (clipped < unclipped).to(logprobs.dtype)
    metrics = {
        "policy/loss": loss.detach(),
        "policy/clip_frac": masked_mean(was_clipped.detach(), acting),
        "dis/ratio_mean": masked_mean(ratio.detach(), acting),
        "dis/approx_kl": _k3_kl(log_ratio.detach(), acting),
    }
    return loss, metrics


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, token-level mean over `mask`:

        v_clip = old + clamp(values - old, -clip_eps, clip_eps)
        loss   = 0.5 * mean_t max((values - R)^2, (v_clip - R)^2)

    `old_values` are the critic's values when the batch was scored (before the K updates); `clip_eps=None`
    gives the plain squared error. Shapes: all `(B, T)`.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    returns, old_values = returns.detach(), old_values.detach()
    err = (values - returns) ** 2
    if clip_eps is None:
        per_token = err
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - returns) ** 2
        per_token = torch.maximum(err, err_clip)
        # Counted where the clamp is active and the clipped error wins. Not `err_clip > err` alone: inside the
        # window `old + (values - old)` differs from `values` by rounding, which that would count as clipping.
        clipped = ((values - old_values).abs() > clip_eps) & (err_clip > err)
        clip_frac = masked_mean(clipped.to(values.dtype), mask)
    loss = 0.5 * masked_mean(per_token, mask)
    metrics = {
        "critic/loss": loss.detach(),
        "critic/clip_frac": clip_frac.detach(),
        "critic/value_mean": masked_mean(values.detach(), mask),
    }
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution per position. Shape: `(..., V)` -> `(...)`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def anchor_kl(logprobs: Tensor, reference_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """The KL anchor (`algo.kl_anchor`): the k3 estimate of KL(current || reference) on the sampled action tokens,

        d_t = reference_logprobs_t - logprobs_t
        kl  = sum_t mask_t * (exp(d_t) - 1 - d_t) / sum_t mask_t

    differentiable in `logprobs` (d kl / d logprobs_t = (1 - exp(d_t)) / sum mask): it pulls a token's probability
    toward the reference's from either side, and is 0 where the two agree. The tokens were sampled by the rollout
    policy, not the current one (GRPO's KL term makes the same approximation)."""
    _check_same_shape(logprobs=logprobs, reference_logprobs=reference_logprobs, action_mask=action_mask)
    return _k3_kl(reference_logprobs - logprobs, action_mask)


def _k3_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimator of KL(rollout || current) from samples of the rollout policy: `(r - 1) - log r`.

    http://joschu.net/blog/kl-approx.html. Unbiased and non-negative. The log-ratio is clamped at 20 so a single
    pathological token reports a large but finite KL.
    """
    lr = log_ratio.clamp(max=20.0)
    return masked_mean(lr.exp() - 1.0 - lr, mask)


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first_name, first = next(iter(shapes.items()))
    for name, shape in shapes.items():
        if shape != first:
            raise ValueError(f"{name} shape {shape} != {first_name} shape {first}")


__all__ = [
    "DIS_PRESETS",
    "anchor_kl",
    "clipped_value_loss",
    "dis_policy_loss",
    "dis_window_mask",
    "entropy_from_logits",
    "ppo_policy_loss",
]

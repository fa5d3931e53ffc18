"""Masked reductions over `[B, T]` token tensors.

Every function takes a `mask` of the same shape as its data (1 where a position counts, 0 elsewhere) and
reduces over all positions of the mini-batch (token-level mean, as DIS and the critic loss require).
An empty mask gives 0, not NaN: a mini-batch with no action token contributes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of `x` where `mask` is set. Shapes: x, mask `(B, T)` (any equal shapes). Returns a scalar."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over positions where `mask` is set; 0 when the mask is empty."""
    count = mask.sum().to(x.dtype)
    return masked_sum(x, mask) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance of `x` over the masked positions; 0 when the mask is empty."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, var: Callable[[Tensor, Tensor], Tensor] = masked_var
) -> Tensor:
    """`1 - Var(returns - values) / Var(returns)` over the masked positions (`var` computes a masked variance,
    e.g. over the tokens of every data-parallel rank).

    1 is a perfect critic, 0 one that predicts the mean, negative one worse than the mean.
    When the returns have (numerically) no variance the ratio is undefined; we return 0 then (nothing
    explained) instead of dividing by a rounding error.

    Shapes: values, returns, mask `(B, T)`. Returns a detached scalar.
    """
    values, returns = values.detach(), returns.detach()
    var_returns = var(returns, mask)
    var_residual = var(returns - values, mask)
    defined = var_returns > 1e-8
    ev = 1.0 - var_residual / torch.where(defined, var_returns, torch.ones_like(var_returns))
    return torch.where(defined, ev, torch.zeros_like(ev))

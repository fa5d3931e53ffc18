"""Skip-observation GAE (docs/design.md section 2; SAO paper, "Skip-Observation GAE").

For action tokens only, with `next(t)` the next position after t whose `action_mask` is 1:

    delta_t = r_t + gamma * V(s_next(t)) - V(s_t)        (V = 0 after the last action token)
    A_t     = delta_t + gamma * lam * A_next(t)
    R_t     = A_t + V(s_t)                               (critic target)

Observation (tool output), prompt and padding tokens never enter the recursion; advantages and returns are
0 there. The ablation `skip_observations=False` makes every position from the first to the last action token
a timestep, using the critic's own values on observation tokens (zero reward there).

`gae` is the fast path: it compacts each row's timesteps to the left, so the recursion becomes a discounted
reverse cumulative sum with one constant factor `gamma * lam`, evaluated as a chunked scan (a matmul inside
each chunk, the same scan one level up for the chunk carries). No Python loop runs over tokens, which matters
at 32k+ token agent trajectories. `gae_reference` is the obviously-correct token loop (vectorised over the
batch only); tests hold the two equal, and `make bench` times one against the other.

Departure from common practice: GAE never normalises advantages here (see `normalize_advantages`);
verl and torchtune whiten inside their estimators, which hides a choice that matters with one rollout per
prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK = 64


def gae(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    gamma: float,
    lam: float,
    skip_observations: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over multi-turn agent trajectories.

    Args:
        rewards: `(B, T)` reward received after token t; non-zero only on action tokens
            (the outcome reward sits on the last action token).
        values: `(B, T)` critic estimate V(s_t) of the state just before token t. Entries at
            positions that are not timesteps are ignored (they may hold anything, even NaN).
        action_mask: `(B, T)` 1 exactly on tokens the policy sampled, else 0.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].
        skip_observations: True for SAO's skip-observation GAE, False for the ablation that steps through
            observation tokens.

    Returns:
        `(advantages, returns)`, both `(B, T)` float32 (float64 if `values` is float64), zero wherever
        `action_mask == 0`; rows without an action token are all zero.
    """
    step = _prepare(rewards, values, action_mask, gamma, lam, skip_observations)
    dtype = _compute_dtype(values)
    batch, length = step.shape
    n_steps = step.sum(dim=1)
    width = int(n_steps.max()) if batch else 0
    if width == 0:
        zeros = torch.zeros(batch, length, dtype=dtype, device=values.device)
        return zeros, zeros.clone()

    # Compact each row's timesteps to the left; positions that are not timesteps land in a dump column
    # (index `width`) that is dropped, so whatever they hold never reaches the arithmetic.
    dest = torch.where(step, step.long().cumsum(dim=1) - 1, torch.full_like(step, width, dtype=torch.long))
    r = _compact(rewards.to(dtype), step, dest, width)
    v = _compact(values.to(dtype), step, dest, width)
    # Past a row's last timestep r = v = 0, so V(s_next) = 0 there and deltas are 0: padding adds nothing.
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = r + gamma * next_v - v
    adv_c = discounted_reverse_cumsum(delta, gamma * lam)
    ret_c = adv_c + v

    keep = action_mask.bool()
    advantages = _expand(adv_c, dest, keep)
    returns = _expand(ret_c, dest, keep)
    return advantages, returns


def length_adaptive_lambda(action_mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive lambda, one per row: `1 - 1 / (alpha * l)` with `l` the row's action tokens, clamped
    to [0, 1] (a row shorter than `1 / alpha` gets 0, one without action tokens 0). `(B,)` float64."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    length = action_mask.bool().sum(dim=1).to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1.0))
    return torch.where(length > 0, lam, torch.zeros_like(lam)).clamp(0.0, 1.0)


def gae_by_row(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    gamma: float,
    lams: Tensor,
    skip_observations: bool = True,
) -> tuple[Tensor, Tensor]:
    """`gae` with a lambda per row (`lams`, `(B,)`): the rows sharing a lambda go through `gae` together, so each row
    gets exactly what `gae` gives it alone at its lambda."""
    if lams.shape != rewards.shape[:1]:
        raise ValueError(f"lams shape {tuple(lams.shape)} != ({rewards.shape[0]},): one lambda per row")
    dtype = _compute_dtype(values)
    advantages = torch.zeros(rewards.shape, dtype=dtype, device=values.device)
    returns = torch.zeros_like(advantages)
    for lam in lams.unique().tolist():
        rows = lams == lam
        advantages[rows], returns[rows] = gae(
            rewards[rows], values[rows], action_mask[rows], gamma, lam, skip_observations
        )
    return advantages, returns


def gae_reference(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    gamma: float,
    lam: float,
    skip_observations: bool = True,
) -> tuple[Tensor, Tensor]:
    """Token-by-token GAE, vectorised over the batch only: the reference `gae` must equal.

    Walks t = T-1 .. 0 carrying V(s_next) and A_next across positions that are not timesteps,
    exactly the recursion in the module docstring. Same arguments and returns as `gae`.
    """
    step = _prepare(rewards, values, action_mask, gamma, lam, skip_observations)
    dtype = _compute_dtype(values)
    r, v = rewards.to(dtype), values.to(dtype)
    batch, length = step.shape
    advantages = torch.zeros(batch, length, dtype=dtype, device=values.device)
    returns = torch.zeros_like(advantages)
    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    for t in reversed(range(length)):
        is_step = step[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(is_step, adv, zero)
        returns[:, t] = torch.where(is_step, adv + v[:, t], zero)
        next_value = torch.where(is_step, v[:, t], next_value)
        next_adv = torch.where(is_step, adv, next_adv)
    keep = action_mask.bool()
    return advantages.where(keep, zero), returns.where(keep, zero)


def discounted_reverse_cumsum(x: Tensor, factor: float, chunk: int = _CHUNK) -> Tensor:
    """`y[:, t] = sum_{k >= t} factor**(k - t) * x[:, k]` along the last dim of a `(B, T)` tensor.

    Chunked scan: inside each chunk of `chunk` positions a matmul with the upper-triangular decay matrix
    gives the local sums; the value at each chunk start then obeys the same recursion with factor
    `factor**chunk` over the chunk starts, solved by calling this function on them (depth log_chunk T).
    Keeping the chunk short keeps `factor**k` far from underflow, unlike the one-shot
    `factor**-t * cumsum(factor**t * x)` trick, which breaks down for long T when factor < 1.
    """
    batch, length = x.shape
    if length <= chunk:
        return x @ _decay_matrix(length, factor, x).T
    n_chunks = -(-length // chunk)
    padded = torch.nn.functional.pad(x, (0, n_chunks * chunk - length))
    local = padded.view(batch, n_chunks, chunk) @ _decay_matrix(chunk, factor, x).T  # (B, n_chunks, chunk)
    starts = discounted_reverse_cumsum(local[:, :, 0], factor**chunk, chunk)  # y at each chunk start
    following = torch.cat([starts[:, 1:], torch.zeros_like(starts[:, :1])], dim=1)  # y at the next start
    offsets = torch.arange(chunk, device=x.device, dtype=torch.float64)
    carry_decay = (factor ** (chunk - offsets)).to(x.dtype)  # factor**(distance to the next chunk start)
    y = local + following[:, :, None] * carry_decay
    return y.reshape(batch, n_chunks * chunk)[:, :length]


def timestep_mask(action_mask: Tensor, skip_observations: bool) -> Tensor:
    """Boolean `(B, T)` mask of the positions GAE treats as timesteps.

    Skip-observation: the action tokens. Ablation: every position from a row's first to its last action token.
    """
    acting = action_mask.bool()
    if skip_observations:
        return acting
    started = acting.long().cumsum(dim=1) > 0
    not_finished = acting.flip(1).long().cumsum(dim=1).flip(1) > 0
    return started & not_finished


def _decay_matrix(size: int, factor: float, like: Tensor) -> Tensor:
    """`M[t, k] = factor**(k - t)` for k >= t, else 0 (`factor**0 = 1`, also when factor = 0)."""
    idx = torch.arange(size, device=like.device, dtype=torch.float64)
    exponent = idx[None, :] - idx[:, None]
    decay = torch.where(exponent >= 0, torch.pow(torch.tensor(factor, dtype=torch.float64), exponent.clamp(min=0)), 0.0)
    return decay.to(like.dtype)


def _compact(x: Tensor, step: Tensor, dest: Tensor, width: int) -> Tensor:
    out = torch.zeros(x.shape[0], width + 1, dtype=x.dtype, device=x.device)
    src = torch.where(step, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return out.scatter_(1, dest, src)[:, :width]


def _expand(compact: Tensor, dest: Tensor, keep: Tensor) -> Tensor:
    padded = torch.cat([compact, torch.zeros_like(compact[:, :1])], dim=1)
    return padded.gather(1, dest).where(keep, torch.zeros((), dtype=compact.dtype, device=compact.device))


def _compute_dtype(values: Tensor) -> torch.dtype:
    return torch.float64 if values.dtype == torch.float64 else torch.float32


def _prepare(
    rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lam: float, skip_observations: bool
) -> Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, T), got shape {tuple(rewards.shape)}")
    for name, tensor in (("values", values), ("action_mask", action_mask)):
        if tensor.shape != rewards.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != rewards shape {tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    acting = action_mask.bool()
    # Trajectory contract (docs/design.md section 5): rewards land on action tokens. A reward elsewhere would be
    # silently dropped by the recursion, so refuse it.
    if bool(((rewards != 0) & ~acting).any()):
        raise ValueError("rewards must be 0 where action_mask == 0 (rewards land on action tokens)")
    return timestep_mask(action_mask, skip_observations)

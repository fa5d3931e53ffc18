"""Per-token log-probs under the sampling distribution, computed in chunks.

`logprobs[b, t] = log_softmax(logits[b, t-1] / T)[x_t]` (docs/design.md section 2), position 0 is 0 (no prediction).
The LM head runs on `chunk_size` positions at a time, so memory stays O(chunk_size x vocab) rather than
O(B x T x vocab), which at a 150k vocabulary and 32k tokens would be hundreds of GB. With autograd on, each
chunk is recomputed in the backward pass (activation checkpointing), so the backward pass holds one
chunk's logits at a time too. Uses logsumexp, so the full log-softmax is never materialised either.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


class TokenStats(NamedTuple):
    """Detached per-position statistics of the sampling distribution, aligned like the log-probs."""

    entropy: Tensor
    """`(B, T)` entropy of the distribution that produced token t (0 at position 0)."""
    is_argmax: Tensor
    """`(B, T)` bool: token t is the distribution's most likely token (False at position 0)."""


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    chunk_size: int = 1024,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, TokenStats]:
    """Log-prob of each token given its prefix.

    Args:
        model: a transformers causal LM (decoder + linear LM head without logit soft-capping).
        input_ids: `(B, T)` token ids.
        temperature: sampling temperature T; logits are divided by it.
        attention_mask: `(B, T)` optional padding mask (right padding).
        chunk_size: positions per LM-head chunk.
        return_stats: also return `TokenStats` (entropy, and whether the token is the argmax) of each position's
            sampling distribution, detached.

    Returns:
        `(B, T)` float32 log-probs (position 0 is 0); with `return_stats`, also the `TokenStats`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits; token_logprobs would not match it")
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    head = model.get_output_embeddings()
    return chunked_head_logprobs(hidden, input_ids, head.weight, head.bias, temperature, chunk_size, return_stats)


def chunked_head_logprobs(
    hidden: Tensor,
    input_ids: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    chunk_size: int = 1024,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, TokenStats]:
    """The chunked LM-head part of `token_logprobs`. hidden `(B, T, H)`, input_ids `(B, T)`, weight `(V, H)`."""
    batch, length, width = hidden.shape
    flat_hidden = hidden[:, :-1].reshape(-1, width)
    targets = input_ids[:, 1:].reshape(-1)
    use_checkpoint = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprob_chunks, entropy_chunks, argmax_chunks = [], [], []
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, y = flat_hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if use_checkpoint:
            lp = checkpoint(_chunk_logprobs, h, y, weight, bias, temperature, use_reentrant=False)
        else:
            lp = _chunk_logprobs(h, y, weight, bias, temperature)
        logprob_chunks.append(lp)
        if return_stats:
            with torch.no_grad():
                entropy, is_argmax = _chunk_stats(h, y, weight, bias, temperature)
            entropy_chunks.append(entropy)
            argmax_chunks.append(is_argmax)
    logprobs = _align(logprob_chunks, batch, length, torch.float32, hidden.device)
    if not return_stats:
        return logprobs
    return logprobs, TokenStats(
        _align(entropy_chunks, batch, length, torch.float32, hidden.device),
        _align(argmax_chunks, batch, length, torch.bool, hidden.device),
    )


def _align(chunks: list[Tensor], batch: int, length: int, dtype: torch.dtype, device) -> Tensor:
    """Per-prediction chunks (positions 1..T-1 flattened) as `(B, T)` with a zero first column."""
    zero_col = torch.zeros(batch, 1, dtype=dtype, device=device)
    if length == 1:
        return zero_col
    return torch.cat([zero_col, torch.cat(chunks).view(batch, length - 1)], dim=1)


def _chunk_logprobs(h: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = F.linear(h, weight, bias).float() / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _chunk_stats(
    h: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
) -> tuple[Tensor, Tensor]:
    logits = F.linear(h, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1), logits.argmax(dim=-1) == targets

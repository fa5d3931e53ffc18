"""Per-token log-probs under the sampling distribution, computed in chunks.

`logprobs[b, t] = log_softmax(logits[b, t-1] / T)[x_t]` (docs/design.md section 2), position 0 is 0 (no prediction).
The LM head runs on `chunk_size` positions at a time, so memory stays O(chunk_size x vocab) rather than
O(B x T x vocab), which at a 150k vocabulary and 32k tokens would be hundreds of GB. With autograd on, each
chunk is recomputed in the backward pass (activation checkpointing), so the backward pass holds one
chunk's logits at a time too. Uses logsumexp, so the full log-softmax is never materialised either.

With `positions` (a `(B, T)` bool mask, the action tokens) the head runs only there: every other position is 0
(entropy 0, not the argmax). Training reads log-probs on action tokens only, and with a Qwen-sized vocabulary
the head is most of the compute: the system prompt with its tool schemas alone is a few hundred tokens per
episode. `head_positions` says when that pays: the gather costs more than it saves for a small vocabulary (the
character tokenizer's 106 entries), whose numbers therefore stay bit-for-bit those of the full head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
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
    positions: Tensor | None = None,
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
        positions: `(B, T)` bool, optional: compute only these positions (the rest are 0 / False).

    Returns:
        `(B, T)` float32 log-probs (position 0 is 0); with `return_stats`, also the `TokenStats`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits; token_logprobs would not match it")
    args = (input_ids, attention_mask, temperature, chunk_size, return_stats, positions)
    return call_as(model, _decoder_then_head, model, *args)


def call_as(module: nn.Module, fn: Callable, *args):
    """`fn(*args)` run as one call of `module`: the module's hooks fire once around it, as around its own forward.

    Under ZeRO-3 that is what DeepSpeed needs. The top module's pre-forward hook starts DeepSpeed's step (without it
    the trace of module calls it prefetches by is never completed, and the record of it grows call after call), and
    the head's hooks gather its weight once around every chunk, forward and backward, instead of once per chunk and
    pass (three times per 1024 positions: the forward, the statistics and the recomputation). The calls inside are
    then the same in every step, whatever the number of chunks, so the trace holds. Without hooks (no ZeRO-3) it is
    `fn(*args)`."""
    module.forward = fn  # an instance attribute: the class's forward comes back with the `del`
    try:
        return module(*args)
    finally:
        del module.forward


def _decoder_then_head(model: PreTrainedModel, input_ids: Tensor, attention_mask, temperature, chunk_size, stats, at):
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return chunked_head_logprobs(hidden, input_ids, model.get_output_embeddings(), temperature, chunk_size, stats, at)


HEAD_GATHER_MIN_VOCAB = 4096
"""From this vocabulary size on, `head_positions` has the head run on the action tokens only."""


def head_positions(model: PreTrainedModel, action_mask: Tensor) -> Tensor | None:
    """`positions` for `token_logprobs` when only the action tokens are read: the action mask for a large
    vocabulary, None (every position) for a small one."""
    weight = model.get_output_embeddings().weight
    vocab = getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 parameter holds a partition: its full shape
    return action_mask.bool() if vocab >= HEAD_GATHER_MIN_VOCAB else None


def chunked_head_logprobs(
    hidden: Tensor,
    input_ids: Tensor,
    head: nn.Module,
    temperature: float,
    chunk_size: int = 1024,
    return_stats: bool = False,
    positions: Tensor | None = None,
) -> Tensor | tuple[Tensor, TokenStats]:
    """The chunked LM-head part of `token_logprobs`. hidden `(B, T, H)`, input_ids `(B, T)`, `head` the LM head
    (an `nn.Linear`, `(H,) -> (V,)`). The chunks read its weight inside one call of the head (`call_as`): under
    ZeRO-3 the weight is a partition that DeepSpeed gathers around that call."""
    if not isinstance(head, nn.Linear):
        raise ValueError(f"head: the LM head must be an nn.Linear, got {type(head).__name__}")
    return call_as(head, _chunked, hidden, input_ids, head, temperature, chunk_size, return_stats, positions)


def _chunked(
    hidden: Tensor,
    input_ids: Tensor,
    head: nn.Linear,
    temperature: float,
    chunk_size: int,
    return_stats: bool,
    positions: Tensor | None,
) -> Tensor | tuple[Tensor, TokenStats]:
    batch, length, width = hidden.shape
    flat_hidden = hidden[:, :-1].reshape(-1, width)
    targets = input_ids[:, 1:].reshape(-1)
    if positions is not None:
        chosen = positions[:, 1:].reshape(-1).nonzero().squeeze(1)
        # One row of n + 1 positions whose n predictions are the chosen ones (the head reads hidden[:, :-1]).
        rows = torch.cat([flat_hidden[chosen], flat_hidden.new_zeros(1, width)])[None]
        result = _chunked(
            rows, torch.cat([targets[:1], targets[chosen]])[None], head, temperature, chunk_size, return_stats, None
        )
        return _scatter(result, chosen, batch, length, hidden.device)
    use_checkpoint = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    logprob_chunks, entropy_chunks, argmax_chunks = [], [], []
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, y = flat_hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if use_checkpoint:
            lp = checkpoint(_chunk_logprobs, h, y, head, temperature, use_reentrant=False)
        else:
            lp = _chunk_logprobs(h, y, head, temperature)
        logprob_chunks.append(lp)
        if return_stats:
            with torch.no_grad():
                entropy, is_argmax = _chunk_stats(h, y, head, temperature)
            entropy_chunks.append(entropy)
            argmax_chunks.append(is_argmax)
    logprobs = _align(logprob_chunks, batch, length, torch.float32, hidden.device)
    if not return_stats:
        return logprobs
    return logprobs, TokenStats(
        _align(entropy_chunks, batch, length, torch.float32, hidden.device),
        _align(argmax_chunks, batch, length, torch.bool, hidden.device),
    )


def _scatter(result, chosen: Tensor, batch: int, length: int, device) -> Tensor | tuple[Tensor, TokenStats]:
    """The `(1, 1 + n)` result over the chosen predictions, put back at their places in `(B, T)`."""

    def place(values: Tensor) -> Tensor:
        flat = torch.zeros(batch * (length - 1), dtype=values.dtype, device=device)
        flat = flat.index_put((chosen,), values[0, 1:])
        return torch.cat([torch.zeros(batch, 1, dtype=values.dtype, device=device), flat.view(batch, length - 1)], 1)

    if isinstance(result, tuple):
        logprobs, stats = result
        return place(logprobs), TokenStats(place(stats.entropy), place(stats.is_argmax))
    return place(result)


def _align(chunks: list[Tensor], batch: int, length: int, dtype: torch.dtype, device) -> Tensor:
    """Per-prediction chunks (positions 1..T-1 flattened) as `(B, T)` with a zero first column."""
    zero_col = torch.zeros(batch, 1, dtype=dtype, device=device)
    if length == 1:
        return zero_col
    return torch.cat([zero_col, torch.cat(chunks).view(batch, length - 1)], dim=1)


def _chunk_logprobs(h: Tensor, targets: Tensor, head: nn.Linear, temperature: float) -> Tensor:
    logits = F.linear(h, head.weight, head.bias).float()
    if temperature != 1.0:  # x / 1.0 == x exactly: skipping it saves a pass over (n, V), forward and backward
        logits = logits / temperature
    if logits.shape[-1] >= HEAD_GATHER_MIN_VOCAB:
        # cross_entropy's fused softmax backward: 1.4x faster than gather - logsumexp at 151k entries on CPU
        return -F.cross_entropy(logits, targets, reduction="none")
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _chunk_stats(h: Tensor, targets: Tensor, head: nn.Linear, temperature: float) -> tuple[Tensor, Tensor]:
    logits = F.linear(h, head.weight, head.bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1), logits.argmax(dim=-1) == targets

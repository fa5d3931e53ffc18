"""Per-token log-probs under the sampling distribution, computed in chunks.

`logprobs[b, t] = log_softmax(logits[b, t-1] / T)[x_t]` (DESIGN section 2), position 0 is 0 (no prediction).
The LM head runs on `chunk_size` positions at a time, so memory stays O(chunk_size x vocab) rather than
O(B x T x vocab), which at a 150k vocabulary and 32k tokens would be hundreds of GB. With autograd on, each
chunk is recomputed in the backward pass (activation checkpointing), so the backward pass holds one
chunk's logits at a time too. Uses logsumexp, so the full log-softmax is never materialised either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    temperature: float = 1.0,
    attention_mask: Tensor | None = None,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-prob of each token given its prefix.

    Args:
        model: a transformers causal LM (decoder + linear LM head without logit soft-capping).
        input_ids: `(B, T)` token ids.
        temperature: sampling temperature T; logits are divided by it.
        attention_mask: `(B, T)` optional padding mask (right padding).
        chunk_size: positions per LM-head chunk.
        return_entropy: also return the (detached) entropy of each position's sampling distribution.

    Returns:
        `(B, T)` float32 log-probs (position 0 is 0); with `return_entropy`, also `(B, T)` entropies aligned
        the same way (entropy of the distribution that produced token t).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits; token_logprobs would not match it")
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    head = model.get_output_embeddings()
    return chunked_head_logprobs(hidden, input_ids, head.weight, head.bias, temperature, chunk_size, return_entropy)


def chunked_head_logprobs(
    hidden: Tensor,
    input_ids: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The chunked LM-head part of `token_logprobs`. hidden `(B, T, H)`, input_ids `(B, T)`, weight `(V, H)`."""
    batch, length, width = hidden.shape
    flat_hidden = hidden[:, :-1].reshape(-1, width)
    targets = input_ids[:, 1:].reshape(-1)
    use_checkpoint = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, flat_hidden.shape[0], chunk_size):
        h, y = flat_hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if use_checkpoint:
            lp = checkpoint(_chunk_logprobs, h, y, weight, bias, temperature, use_reentrant=False)
        else:
            lp = _chunk_logprobs(h, y, weight, bias, temperature)
        logprob_chunks.append(lp)
        if return_entropy:
            with torch.no_grad():
                entropy_chunks.append(_chunk_entropy(h, weight, bias, temperature))
    zero_col = torch.zeros(batch, 1, dtype=torch.float32, device=hidden.device)
    logprobs = torch.cat([zero_col, torch.cat(logprob_chunks).view(batch, length - 1)], dim=1) if length > 1 \
        else zero_col
    if not return_entropy:
        return logprobs
    entropy = torch.cat([zero_col, torch.cat(entropy_chunks).view(batch, length - 1)], dim=1) if length > 1 \
        else zero_col
    return logprobs, entropy


def _chunk_logprobs(h: Tensor, targets: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = F.linear(h, weight, bias).float() / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = F.linear(h, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)

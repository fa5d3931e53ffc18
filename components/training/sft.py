"""Supervised fine-tuning of the policy on TIR traces, loss on action tokens only.

The loss is the mean negative log-likelihood over the assistant's tokens (tool calls and answers);
prompt and tool-output tokens only condition the model, they are never targets, which is what lets
the policy learn to call the tool rather than to imitate the tool's output.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from components.algo import masked_mean
from components.chat import ChatFormat, render_trace
from components.config import SFTConfig
from components.contracts.trace import Trace
from components.models.logprobs import head_positions, token_logprobs
from components.training.batching import pad_batch
from components.training.schedule import warmup_cosine


@dataclass(frozen=True)
class SFTResult:
    steps: int
    """Optimizer steps taken."""
    final_loss: float
    """Mean action-token NLL over the last `log_every` steps."""
    seconds: float
    """Wall time of the training loop."""
    tokens_per_s: float
    """Trained (action) tokens per second."""


def train_sft(
    model: PreTrainedModel,
    chat: ChatFormat,
    traces: list[Trace],
    cfg: SFTConfig,
    log: Callable[[str], None] = print,
    tools: tuple[dict, ...] = (),
) -> SFTResult:
    """Train `model` in place on `traces`, rendered in the chat format `chat` with the environment's `tools`,
    for `cfg.steps` AdamW steps."""
    if not traces:
        raise ValueError("traces: no training traces")
    tokenizer = chat.tokenizer
    rendered = [render_trace(chat, t, tools) for t in traces]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    model.train()
    order: list[int] = []
    window_loss, window_tokens, total_tokens = 0.0, 0, 0
    recent_loss = float("nan")
    start = time.perf_counter()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(rendered)), len(rendered))
        batch, order = order[: cfg.batch_size], order[cfg.batch_size :]
        ids, attention, action = pad_batch(
            [rendered[i][0] for i in batch], [rendered[i][1] for i in batch], tokenizer.pad_token_id
        )
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup_steps)
        logprobs = token_logprobs(model, ids, 1.0, attention_mask=attention, positions=head_positions(model, action))
        loss = -masked_mean(logprobs, action)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        n_tokens = int(action.sum())
        window_loss += loss.item() * n_tokens
        window_tokens += n_tokens
        total_tokens += n_tokens
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            recent_loss = window_loss / max(window_tokens, 1)
            elapsed = time.perf_counter() - start
            log(
                f"sft step {step + 1:>5}/{cfg.steps}  loss {recent_loss:.4f}  "
                f"{total_tokens / elapsed:,.0f} action tok/s  {elapsed:.0f}s"
            )
            window_loss, window_tokens = 0.0, 0
    model.eval()
    elapsed = time.perf_counter() - start
    return SFTResult(cfg.steps, recent_loss, elapsed, total_tokens / elapsed)

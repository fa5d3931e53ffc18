"""Supervised fine-tuning of the policy on TIR traces, loss on action tokens only.

The loss is the mean negative log-likelihood over the assistant's tokens (tool calls and answers);
prompt and tool-output tokens only condition the model, they are never targets, which is what lets
the policy learn to call the tool rather than to imitate the tool's output.

The steps run on a training engine (components/training/engines/engine.py): the torch engine in one process, or DeepSpeed
on every rank under torchrun. Every rank draws the same batch of traces (one seeded order) and trains its rows of
it, in micro-batches within `train.micro_batch_tokens`, each micro-batch's loss scaled by its share of the batch's
action tokens (components/training/engines/micro.py): the step is the single-process step of the whole batch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.algo import masked_mean
from components.chat import ChatFormat, render_trace
from components.config import SFTConfig
from components.contracts.trace import Trace
from components.models.logprobs import head_positions, token_logprobs
from components.training.engines.batching import pad_batch
from components.training.engines.collective import SOLO, Collective
from components.training.engines.micro import MicroBatches, TokenWeighted, rank_share
from components.training.engines.schedule import warmup_cosine


@dataclass(frozen=True)
class SFTResult:
    steps: int
    """Optimizer steps taken."""
    final_loss: float
    """Mean action-token NLL over the last `log_every` steps."""
    seconds: float
    """Wall time of the training loop."""
    tokens_per_s: float
    """Trained (action) tokens per second, on all ranks together."""


def train_sft(
    engine,
    chat: ChatFormat,
    traces: list[Trace],
    cfg: SFTConfig,
    log: Callable[[str], None] = print,
    tools: tuple[dict, ...] = (),
    comm: Collective = SOLO,
    micro_batch_tokens: int = 0,
) -> SFTResult:
    """Train `engine`'s module in place on `traces`, rendered in the chat format `chat` with the environment's
    `tools`, for `cfg.steps` steps at SFT's learning-rate schedule (the engine brings the optimizer and the clip).
    Under torchrun every rank calls this with the same traces and takes its rows of each batch."""
    if not traces:
        raise ValueError("traces: no training traces")
    tokenizer = chat.tokenizer
    rendered = [render_trace(chat, t, tools) for t in traces]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = engine.module
    device = next(model.parameters()).device
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
        whole = {"input_ids": ids, "attention_mask": attention, "action_mask": action}
        mine, idle = rank_share(whole, comm)
        engine.set_lr(warmup_cosine(step, cfg.steps, cfg.lr, cfg.min_lr, cfg.warmup_steps))
        loss, n_tokens = _step(engine, {k: v.to(device) for k, v in mine.items()}, idle, comm, micro_batch_tokens)
        window_loss += loss * n_tokens
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


def _step(engine, batch: dict, idle: bool, comm: Collective, budget: int) -> tuple[float, int]:
    """One optimizer step on this rank's rows; (the whole batch's mean action-token NLL, its action tokens)."""
    micro = MicroBatches.plan(batch, budget, comm, idle)
    weighted = TokenWeighted(micro)
    for i in range(len(micro)):
        mb = micro.take(batch, i)
        a = mb["action_mask"]
        logprobs = token_logprobs(
            engine.module,
            mb["input_ids"],
            1.0,
            attention_mask=mb["attention_mask"],
            positions=head_positions(engine.module, a),
        )
        loss = -masked_mean(logprobs, a)
        if not engine.accumulate(loss * micro.share(i), last=micro.last(i)):
            break
        weighted.add({"loss": loss.detach()}, i)
    engine.apply()
    metrics = weighted.result()
    tokens = int(micro.n_total.item()) if not micro.whole else int(batch["action_mask"].sum())
    return (float(metrics["loss"]) if "loss" in metrics else float("nan")), tokens

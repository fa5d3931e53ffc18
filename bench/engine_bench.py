"""Embedded engine throughput (issue 3), every figure measured in the same run on the same model.

- engine: `sao engine serve` in its own process (as deployed: the agent runner is another process) and 32
  concurrent HTTP clients on loopback, each sending requests back to back (64 new tokens, T=1, no stop).
- baseline: `model.generate` on a static batch of 32 with the same lengths. Goal: engine >= 0.7x.
- transformers' continuous-batching manager (`generate_batch`) on a smaller workload.
- weight publish latency: `POST /v1/weights` with an HF model directory, measured while clients generate.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import GenerationConfig

from components.config import ModelConfig
from components.models import build_policy, build_tokenizer, save_model_dir
from components.rollout.client import EngineClient
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest
from components.rollout.server import serve_subprocess

NEW_TOKENS = 64
CLIENTS = 32
SERVER_THREADS = 1


def _prompts(tokenizer, n):
    return [
        tokenizer(f"<|user|>Compute {i % 90 + 10}*{i % 7 + 3}+{i % 50}.<|assistant|>")["input_ids"] for i in range(n)
    ]


def _static_generate(model, tokenizer, prompts) -> float:
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), tokenizer.pad_token_id)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, length - len(p) :] = torch.tensor(p)
        attention[row, length - len(p) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - length) * len(prompts) / elapsed


async def _clients(url, prompts, rounds) -> tuple[int, float]:
    async with EngineClient(url) as client:

        async def worker(i):
            n = 0
            for r in range(rounds):
                result = await client.generate(SamplingRequest(prompts[i], NEW_TOKENS, 1.0, seed=i * 100 + r))
                n += len(result.token_ids)
            return n

        start = time.perf_counter()
        counts = await asyncio.gather(*[worker(i) for i in range(len(prompts))])
        return sum(counts), time.perf_counter() - start


def _continuous_batching(model, prompts) -> float:
    config = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.generated_tokens) for o in out.values()) / elapsed


def _in_process_engine(model, tokenizer, prompts) -> float:
    engine = EmbeddedEngine(model, tokenizer, max_batch=CLIENTS)
    futures = [engine.submit(SamplingRequest(p, NEW_TOKENS, 1.0, seed=i)) for i, p in enumerate(prompts * 3)]
    start = time.perf_counter()
    while not all(f.done() for f in futures):
        engine.step()
    return sum(len(f.result().token_ids) for f in futures) / (time.perf_counter() - start)


def run() -> dict[str, float]:
    tokenizer = build_tokenizer()
    model = build_policy(ModelConfig(), tokenizer, seed=0).eval()
    prompts = _prompts(tokenizer, CLIENTS)
    _static_generate(model, tokenizer, prompts[:4])  # warm-up
    static_all = statistics.median(_static_generate(model, tokenizer, prompts) for _ in range(3))
    # The served engine shares the machine with its 32 clients, so it gets one core (`--threads 1`); the
    # baseline and the in-process engine get the same compute budget.
    all_threads = torch.get_num_threads()
    torch.set_num_threads(SERVER_THREADS)
    static = statistics.median(_static_generate(model, tokenizer, prompts) for _ in range(3))

    with tempfile.TemporaryDirectory() as tmp:
        weights = save_model_dir(model, tokenizer, Path(tmp) / "w")
        with serve_subprocess(weights, SERVER_THREADS) as url:
            asyncio.run(_clients(url, prompts[:4], 1))  # warm-up
            tokens, elapsed = asyncio.run(_clients(url, prompts, rounds=3))
            served = tokens / elapsed
            publish = []
            for version in range(1, 6):
                start = time.perf_counter()
                response = httpx.post(f"{url}/v1/weights", json={"path": str(weights), "version": version}, timeout=60)
                response.raise_for_status()
                publish.append(time.perf_counter() - start)
        in_process = _in_process_engine(model, tokenizer, prompts)
    cb = _continuous_batching(model, prompts[:8])
    torch.set_num_threads(all_threads)

    ratio = served / static
    print(
        f"engine  tiny-cpu model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M), "
        f"{NEW_TOKENS} new tokens per request, T=1"
    )
    print(f"  model.generate, static batch of {CLIENTS}, {all_threads} threads: {static_all:9,.0f} tok/s  (reference)")
    print(f"  model.generate, static batch of {CLIENTS}, 1 thread:  {static:9,.0f} tok/s  (baseline)")
    print(
        f"  embedded engine, {CLIENTS} concurrent HTTP clients: {served:9,.0f} tok/s  "
        f"({ratio:.2f}x static; goal >= 0.7x: {'met' if ratio >= 0.7 else 'NOT met'})"
    )
    print(
        f"  embedded engine in-process (no HTTP), 96 requests: {in_process:9,.0f} tok/s  ({in_process / static:.2f}x)"
    )
    print(f"  transformers continuous batching (8 x 16 tok):   {cb:9,.0f} tok/s  ({served / cb:.0f}x slower than ours)")
    print(
        f"  weight publish (HF dir, POST /v1/weights, idle engine): median {statistics.median(publish) * 1e3:.0f} ms "
        f"(read + validate + apply)"
    )
    print(f"  served engine vs the {all_threads}-thread static batch: {served / static_all:.2f}x")
    return {"engine_vs_static": ratio, "engine_tok_s": served, "static_tok_s": static, "cb_tok_s": cb}

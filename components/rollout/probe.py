"""A guard against weight updates that silently do nothing: after an update, each server samples fixed prompts and
its log-probs of what it sampled are compared with the trainer's own (teacher-forced, on the version it sent).

A transport that drops the tensors, a worker extension that reloads from the wrong place, or a server that
kept an old version all pass the HTTP call and fail here: the server's log-probs are those of another model.
The statistic is the median |log-prob difference| over every probe token, `PROBE_REQUESTS` prompts of
`PROBE_TOKENS` tokens each. A median, because at bf16 a few tokens always differ by a lot: a sampled token of low
probability sits where the log-softmax is steep, and an MoE's top-k routing can flip on a near-tie, so one token
of 128 may be off by several nats while the weights are the same (measured on the tiny-cpu policy: a bf16 server
against a bf16 trainer, max 7.1 with a median of 1e-4). A median above `tolerance` (or a token tagged with another
version) takes the server out of the pool for the rest of the run (`rollout.probe_every`, `rollout.probe_tolerance`;
docs/design.md section 7).

The tolerance follows the dtype of the weights (`tolerance_for`), unless `rollout.probe_tolerance` sets one. The bf16
figure sits between what rounding does and what a broken load does, measured on the tiny-cpu SFT policy over ten
rounds of 4 x 32 probe tokens (docs/gpu.md, "The weights probe at bf16"): a bf16 server against an fp32 trainer,
median 0.0009-0.0052; a server with one MLP zeroed, 0.076-0.53; with one attention output zeroed, 3.4-7.7. A single
dropped update of a small learning rate moves the median by less than bf16 rounding does, so at bf16 the probe
catches a transport that loads nothing, the wrong tensors or a part of them, and a server many versions behind,
not one missed step; the version tags and the transfer's own accounting cover that. At fp32 it catches one step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch import nn

from components.models import token_logprobs
from components.rollout.protocol import SamplingRequest, SamplingResult

PROBE_REQUESTS = 4
PROBE_TOKENS = 32
PROBE_SEED = 20261203

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.0125}
"""The probe's default tolerance (median |log-prob difference|) by the dtype the weights are served in. fp32: the
embedded engine and the trainer agree to ~1e-6. bf16: ten times the largest median measured for rounding alone
(0.0052, fp32 against bf16 on the tiny-cpu policy), for a larger model's larger logits and another implementation's
kernels, and below the smallest broken load measured (0.076). fp16: bf16's scaled by their epsilons (2^-10 / 2^-8)."""


class WeightsMismatch(RuntimeError):
    """A server serves other weights than the trainer sent it (the message names the server)."""


@dataclass(frozen=True)
class ProbeResult:
    url: str
    median_abs_diff: float
    """The statistic compared with the tolerance: the median |log-prob difference| over the probe's tokens."""
    max_abs_diff: float
    """The largest one (reported, not compared: a single token may differ by a lot at bf16)."""
    versions_ok: bool

    def ok(self, tolerance: float) -> bool:
        return self.versions_ok and self.median_abs_diff <= tolerance


def tolerance_for(model: nn.Module, configured: float | None = None) -> float:
    """`configured` when set; else the loosest `TOLERANCE` of the dtypes the weights are held in and declared in
    (the model's parameters and its config's `dtype`, which a vLLM server started with `--dtype auto` serves in)."""
    if configured is not None:
        return configured
    dtypes = {p.dtype for p in model.parameters()}
    declared = getattr(model.config, "dtype", None) if hasattr(model, "config") else None
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if isinstance(declared, torch.dtype):
        dtypes.add(declared)
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in dtypes)


def probe_requests(vocab_size: int, prompt_len: int = 16) -> list[SamplingRequest]:
    """`PROBE_REQUESTS` fixed prompts of random token ids (the same every run), each sampled at temperature 1 with a
    fixed seed."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    prompts = [torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(PROBE_REQUESTS)]
    return [
        SamplingRequest(prompt, max_tokens=PROBE_TOKENS, temperature=1.0, seed=PROBE_SEED + i)
        for i, prompt in enumerate(prompts)
    ]


def compare(url: str, model: nn.Module, results: list[SamplingResult], version: int) -> ProbeResult:
    """How far `results`' log-probs are from `model`'s on the same tokens, and whether every token says `version`."""
    device = next(model.parameters()).device
    diffs: list[float] = []
    for result in results:
        ids = torch.tensor([result.prompt_ids + result.token_ids], device=device)
        with torch.no_grad():
            reference = token_logprobs(model, ids, 1.0)[0, len(result.prompt_ids) :].float().cpu()
        diffs += (torch.tensor(result.logprobs, dtype=torch.float32) - reference).abs().tolist()
    versions_ok = all(v == version for result in results for v in result.versions)
    if not diffs:
        return ProbeResult(url, 0.0, 0.0, versions_ok)
    return ProbeResult(url, statistics.median(diffs), max(diffs), versions_ok)

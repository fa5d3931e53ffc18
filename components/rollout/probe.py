"""A guard against weight updates that silently do nothing: after an update, each server samples a fixed prompt and
its log-probs of what it sampled are compared with the trainer's own (teacher-forced, on the version it sent).

A transport that drops the tensors, a worker extension that reloads from the wrong place, or a server that
kept an old version all pass the HTTP call and fail here: the server's log-probs are those of another model.
A mismatch above `tolerance` (or a token tagged with another version) takes the server out of the pool for the
rest of the run (`rollout.probe_every`, `rollout.probe_tolerance`; docs/design.md section 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from components.models import token_logprobs
from components.rollout.protocol import SamplingRequest, SamplingResult

PROBE_TOKENS = 8
PROBE_SEED = 20261203


class WeightsMismatch(RuntimeError):
    """A server serves other weights than the trainer sent it (the message names the server)."""


@dataclass(frozen=True)
class ProbeResult:
    url: str
    max_abs_diff: float
    versions_ok: bool

    def ok(self, tolerance: float) -> bool:
        return self.versions_ok and self.max_abs_diff <= tolerance


def probe_request(vocab_size: int, prompt_len: int = 16) -> SamplingRequest:
    """A fixed prompt of random token ids (the same every run), sampled at temperature 1 with a fixed seed."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()
    return SamplingRequest(prompt, max_tokens=PROBE_TOKENS, temperature=1.0, seed=PROBE_SEED)


def compare(url: str, model: nn.Module, result: SamplingResult, version: int) -> ProbeResult:
    """How far `result`'s log-probs are from `model`'s on the same tokens, and whether every token says `version`."""
    ids = torch.tensor([result.prompt_ids + result.token_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        reference = token_logprobs(model, ids, 1.0)[0, len(result.prompt_ids) :].float().cpu()
    served = torch.tensor(result.logprobs, dtype=torch.float32)
    diff = float((served - reference).abs().max()) if len(result.logprobs) else 0.0
    return ProbeResult(url, diff, all(v == version for v in result.versions))
